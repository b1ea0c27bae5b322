"""Where a synced step's time goes: the host's time per call before its replay, concur's step against the recipe's.

    PYTHONPATH=. python -m experiments.host_time --model googlenet --batch 8 [--compile] [--streams 1 4]
        [--rounds 6] [--calls 20] [--profile 10] [--python 50] [--json FILE]

A loop that reads its loss after every step (``loss.item()``) waits for each
step, so whatever the host does before the step's replay is launched adds to
the step's time: the sweep's "synced" column. This tool builds PyTorch's
whole-step recipe (``experiments/peers.py``: ``eager_graph``, or
``compile_graph`` with ``--compile``) and concur's ``train_step`` with each of
``--streams`` on one seeded model (bf16 autocast, channels-last, SGD momentum,
as ``sweep_models.cuda_setup``), then times them in alternating rounds. Per
side and call:

- ``host_us``: the call's host time, the GPU idle when it starts;
- ``before_replay_us``: from the call to the launch of its CUDA graph
  (``torch.cuda.CUDAGraph.replay`` is wrapped to stamp its entry), the part a
  synced loop waits for;
- ``synced_ms``: CUDA events around one call, waited for; ``ms``: the mean of
  back-to-back calls between two events (the host's time hidden).

Medians over rounds; the table gives each against the recipe's. With
``--profile N``, torch.profiler records N synced calls per side, and the
host's operations are listed by self CPU time (the ten largest per side).
With ``--python N``, cProfile records N synced calls per side, and the
Python functions are listed by their own time (the fifteen largest per side):
what the host spends that is not a torch operation.
With ``--device cpu`` (a check of the tool, no graphs) the recipe is the
plain loop and concur runs eagerly: only ``host_us``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import peers, sweep_models  # noqa: E402


class ReplayStamps:
    """Wraps ``torch.cuda.CUDAGraph.replay`` while active: the perf_counter at the entry of the last replay."""

    def __init__(self) -> None:
        self.last: float | None = None
        self._original = None

    def __enter__(self) -> "ReplayStamps":
        self._original = original = torch.cuda.CUDAGraph.replay

        def replay(graph: torch.cuda.CUDAGraph) -> None:
            self.last = time.perf_counter()
            original(graph)

        torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.CUDAGraph.replay = self._original


def build_sides(model_name: str, batch: int, device: str, compile: bool, streams: list[str]
                ) -> tuple[tuple, dict[str, Callable[[], torch.Tensor]]]:
    """The batch and ``{side: call}``: the recipe first, then concur's step for each stream count."""
    import concur

    sides: dict[str, Callable[[], torch.Tensor]] = {}
    amp = torch.bfloat16 if device == "cuda" else None
    for side in ["recipe", *(f"concur_streams{s}" for s in streams)]:
        torch.manual_seed(0)
        model, size = sweep_models.build(model_name)
        model = model.to(device).to(memory_format=torch.channels_last).train()
        x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
        y = torch.randint(0, sweep_models.NUM_CLASSES, (batch,), device=device)
        loss_fn = nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if side == "recipe":
            recipe = ("compile_graph" if compile else "eager_graph") if device == "cuda" else "eager"
            step = peers.RECIPES[recipe](model, loss_fn, opt, (x, y), amp)
        else:
            s = side.removeprefix("concur_streams")
            step = concur.train_step(model, loss_fn, opt, (x, y), streams=s if s == "auto" else int(s),
                                     compile=compile, amp_dtype=amp)
            for _ in range(200):  # an unfused step times its programs on its first calls
                step(x, y)
                if not getattr(step, "deciding", False):
                    break
        sides[side] = lambda step=step, x=x, y=y: step(x, y)
    return (x, y), sides


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_round(call: Callable[[], torch.Tensor], calls: int, device: str, stamps: ReplayStamps) -> dict:
    """One round of one side: ``calls`` synced calls (host, before replay, synced ms), then as many back to back."""
    host, before, synced = [], [], []
    for _ in range(calls):
        _sync(device)
        stamps.last = None
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        if stamps.last is not None:
            before.append((stamps.last - t0) * 1e6)
        if device == "cuda":
            end.record()
            end.synchronize()
            synced.append(start.elapsed_time(end))
    row = {"host_us": statistics.median(host), "before_replay_us": statistics.median(before) if before else None,
           "synced_ms": statistics.median(synced) if synced else None, "ms": None}
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        call()
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        row["ms"] = start.elapsed_time(end) / calls
    return row


def profile_side(call: Callable[[], torch.Tensor], calls: int, device: str, top: int = 10) -> list[dict]:
    """The host's operations over ``calls`` synced calls, by self CPU time: name, count, us per call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
            _sync(device)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"name": e.key, "count_per_call": e.count / calls, "self_cpu_us_per_call": e.self_cpu_time_total / calls}
            for e in events]


def python_side(call: Callable[[], torch.Tensor], calls: int, device: str, top: int = 15) -> list[dict]:
    """The Python functions over ``calls`` synced calls, by their own time: where, count and us per call."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(calls):
        _sync(device)
        profiler.runcall(call)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, ...)}
    rows = [{"name": f"{Path(f).name}:{line}({name})", "count_per_call": n / calls,
             "self_cpu_us_per_call": own * 1e6 / calls, "cumulative_us_per_call": cum * 1e6 / calls}
            for (f, line, name), (_, n, own, cum, _) in stats.items()]
    return sorted(rows, key=lambda r: r["self_cpu_us_per_call"], reverse=True)[:top]


def run(args: argparse.Namespace) -> list[dict]:
    _, sides = build_sides(args.model, args.batch, args.device, args.compile, args.streams)
    samples: dict[str, list[dict]] = {side: [] for side in sides}
    with ReplayStamps() as stamps:
        for side, call in sides.items():  # warm: the first calls after setup
            for _ in range(3):
                call()
        for _ in range(args.rounds):
            for side, call in sides.items():
                samples[side].append(time_round(call, args.calls, args.device, stamps))
    rows = []
    for side, rounds in samples.items():
        row = {"model": args.model, "batch": args.batch, "device": args.device, "compile": args.compile,
               "side": side, "rounds": len(rounds), "calls_per_round": args.calls,
               "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
        for key in ("host_us", "before_replay_us", "synced_ms", "ms"):
            values = [r[key] for r in rounds if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        if args.profile:
            row["host_ops"] = profile_side(sides[side], args.profile, args.device)
        if args.python:
            row["python_functions"] = python_side(sides[side], args.python, args.device)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    recipe = next(r for r in rows if r["side"] == "recipe")

    def cell(r: dict, key: str, fmt: str) -> str:
        return "" if r[key] is None else format(r[key], fmt)

    lines = ["| side | host us | before replay us | synced ms | ms | synced vs recipe | ms vs recipe |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = {k: (f"{recipe[k] / r[k]:.3f}x" if recipe[k] and r[k] else "") for k in ("synced_ms", "ms")}
        lines.append(f"| {r['side']} | {cell(r, 'host_us', '.1f')} | {cell(r, 'before_replay_us', '.1f')} | "
                     f"{cell(r, 'synced_ms', '.3f')} | {cell(r, 'ms', '.3f')} | {ratio['synced_ms']} | {ratio['ms']} |")
    for r in rows:
        for op in r.get("host_ops", []) + r.get("python_functions", []):
            lines.append(f"  {r['side']}: {op['name'][:60]:60s} {op['count_per_call']:6.1f}/call "
                         f"{op['self_cpu_us_per_call']:8.1f} us/call")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="googlenet", help="a sweep model name (experiments/sweep_models.py)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--compile", action="store_true", help="the fused path, against compile + whole-step graph")
    p.add_argument("--streams", nargs="+", default=["1", "4"], help="concur's stream counts (or auto)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=20, help="synced calls per side and round, then as many back to back")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile N synced calls per side")
    p.add_argument("--python", type=int, default=0, metavar="N",
                   help="cProfile N synced calls per side: the Python functions by their own time")
    p.add_argument("--json", type=Path, help="append one row per side (JSONL)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for s in args.streams:
        if s != "auto" and not (s.isdigit() and int(s) >= 1):
            raise SystemExit(f"host_time: --streams takes positive integers or auto, not {s!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("host_time: no CUDA device here; --device cpu checks the tool without graphs")
    rows = run(args)
    print("\n".join(table(rows)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())

"""Who holds the memory of a captured step, against PyTorch's recipe (experiments/peers.py), from the allocator's history.

    PYTHONPATH=. python experiments/memory_diff.py --model resnet50 --batch 8 --who concur [--compile] [--streams 1]
        [--lean-pools]

Records the caching allocator's history through setup (building the step,
its capture) and three calls, then prints, grouped by the Python line that
allocated them (the innermost frame in concur, experiments or the model):
the tensors live at the setup's peak of allocated memory, and those live
once set up. Run it once per side (``--who recipe`` and ``--who concur``):
allocator statistics are per process. Concur's side times its decisions with
an empty decision cache of its own, as a first run does, unless
``$CONCUR_CACHE_DIR`` names one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from typing import Iterator

import torch

from experiments import peers
from experiments.sweep_models import cuda_setup

_OURS = ("/concur/", "/experiments/", "/torchvision/models/")


def _site(frames: list) -> str:
    """The innermost frame of ours (concur, experiments, the model) and the innermost torch frame above it."""
    torch_frame = next((f for f in frames if "/torch/" in f["filename"]), None)
    ours = next((f for f in frames if any(s in f["filename"] for s in _OURS)), None)
    name = lambda f: f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"  # noqa: E731
    return (name(ours) if ours else "?") + ("  <- " + torch_frame["name"] if torch_frame else "")


def _live_at_peak_and_end(trace: list) -> tuple[int, dict, dict]:
    live, total, peak, at_peak = {}, 0, -1, {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak, live


_SEGMENT_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _segment_changes(trace: list) -> Iterator[tuple[dict, int]]:
    """Each event of the trace that changes reserved memory, with the bytes it adds (negative: gives back)."""
    for event in trace:
        sign = _SEGMENT_SIGN.get(event["action"])
        if sign is not None:
            yield event, sign * event["size"]


def _reserved_by_stream_at_peak(trace: list) -> tuple[int, dict]:
    """Reserved memory by stream at the trace's peak of reserved memory, from its segment events."""
    by_stream, total, peak, at_peak = collections.Counter(), 0, -1, {}
    for event, size in _segment_changes(trace):
        by_stream[event["stream"]] += size
        total += size
        if total > peak:
            peak, at_peak = total, dict(by_stream)
    return peak, {k: v for k, v in at_peak.items() if v}


def _reserved_peak_growth_by_site(trace: list) -> list[tuple[str, float, int]]:
    """Which lines raised setup's peak of reserved memory: each new segment that took the total above its
    peak so far, the rise (MB) summed by the allocating site (several pools or streams cache apart)."""
    groups = collections.defaultdict(lambda: [0, 0])
    total = peak = 0
    for event, size in _segment_changes(trace):
        total += size
        if total > peak:
            g = groups[f"stream {event['stream']}  " + _site(event.get("frames", []))]
            g[0] += total - peak
            g[1] += 1
            peak = total
    return sorted(((k, v[0] / 2**20, v[1]) for k, v in groups.items()), key=lambda r: -r[1])


def _held_by_pool_and_stream(segments: list) -> list[tuple[str, float, float]]:
    """Reserved and allocated memory held once set up, per (memory pool, stream): where a multi-stream pool fragments."""
    groups = collections.defaultdict(lambda: [0, 0])
    for seg in segments:
        g = groups[f"pool {tuple(seg.get('segment_pool_id', (0, 0)))} stream {seg['stream']}"]
        g[0] += seg["total_size"]
        g[1] += seg["allocated_size"]
    return sorted(((k, v[0] / 2**20, v[1] / 2**20) for k, v in groups.items()), key=lambda r: -r[1])


def _by_site(live: dict) -> list[tuple[str, float, int]]:
    groups = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        g = groups[_site(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    return sorted(((k, v[0] / 2**20, v[1]) for k, v in groups.items()), key=lambda r: -r[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the model, its batch, which side (``--who``), and where the row goes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--who", choices=("recipe", "concur"), required=True)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-step-decision", action="store_true",
                    help="leave out train_step's decision over the whole step (concur.training.step_streams)")
    ap.add_argument("--lean-pools", action="store_true",
                    help="concur's unfused plans save no max-pooling indices from the start "
                         "(concur.training.rungs.LEAN_POOLS_FIRST)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("memory_diff.py reads the CUDA caching allocator's history: it needs a GPU")
    if args.who == "concur" and not os.environ.get("CONCUR_CACHE_DIR"):
        # a first run's setup: its decisions timed, not read back from what an earlier process (a GPU test beside
        # this one, a run before) stored in the shared cache
        os.environ["CONCUR_CACHE_DIR"] = tempfile.mkdtemp(prefix="concur_decisions_")
    if args.no_step_decision:
        import concur.training.step as step_module
        step_module.decide_step_streams = lambda *a, **k: None
    if args.lean_pools:
        from concur.training import rungs
        rungs.LEAN_POOLS_FIRST = True
    model, batch, loss_fn, opt = cuda_setup(args.model, args.batch)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    if args.who == "recipe":
        make = peers.compile_graph_step if args.compile else peers.eager_graph_step
        step = make(model, loss_fn, opt, batch, amp_dtype=torch.bfloat16)
    else:
        import concur
        step = concur.train_step(model, loss_fn, opt(model.parameters()), batch, streams=args.streams,
                                 amp_dtype=torch.bfloat16, compile=args.compile)
    step(*batch)
    # an unfused step times its programs on its first calls (concur.training.trial): that is setup too, and so is
    # the capture again where it dropped a program, on the call after
    for _ in range(200):
        if not getattr(step, "deciding", False):
            break
        step(*batch)
    for _ in range(3):
        step(*batch)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    mb = lambda n: n / 2**20  # noqa: E731
    stats = {"setup_peak_allocated_mb": mb(torch.cuda.max_memory_allocated() - before),
             "setup_peak_reserved_mb": mb(torch.cuda.max_memory_reserved()),
             "held_allocated_mb": mb(torch.cuda.memory_allocated() - before),
             "held_reserved_mb": mb(torch.cuda.memory_reserved())}
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, at_peak, end = _live_at_peak_and_end(trace)
    label = f"{args.who} {args.model} b{args.batch} {'compiled' if args.compile else 'eager'} streams={args.streams}" + \
        (" (no step decision)" if args.no_step_decision else "") + (" (lean pools)" if args.lean_pools else "") + \
        (" (timing off)" if args.who == "concur" and os.environ.get("CONCUR_MEASURE") == "0" else "")
    print(f"\n{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in stats.items()) + f"; traced peak {mb(peak):.1f} MB")
    rows = {}
    for title, live in (("live at the setup peak", at_peak), ("live once set up", end)):
        rows[title] = _by_site(live)[:15]
        print(f"  {title}:")
        for site, size_mb, n in rows[title]:
            print(f"    {size_mb:9.1f} MB {n:5d}  {site}")
    # the caching allocator reuses a freed block only on the stream it was allocated on, in a graph's pool too
    rows["held_by_pool_stream"] = _held_by_pool_and_stream(snapshot["segments"])
    print("  reserved / allocated once set up, by pool and stream:")
    for where, reserved, allocated in rows["held_by_pool_stream"]:
        print(f"    {reserved:9.1f} / {allocated:9.1f} MB  {where}")
    reserved_peak, by_stream = _reserved_by_stream_at_peak(trace)
    rows["setup_reserved_by_stream"] = {str(k): v / 2**20 for k, v in by_stream.items()}
    print(f"  reserved at its traced peak ({mb(reserved_peak):.1f} MB), by stream: "
          + ", ".join(f"{k}: {v / 2**20:.1f}" for k, v in sorted(by_stream.items(), key=lambda kv: -kv[1])))
    rows["reserved_peak_growth"] = _reserved_peak_growth_by_site(trace)[:12]
    print("  what raised the reserved peak, by stream and site (MB, new segments):")
    for site, size_mb, n in rows["reserved_peak_growth"]:
        print(f"    {size_mb:9.1f} MB {n:5d}  {site}")
    # cuBLAS keeps one workspace per (handle, stream) for the life of the process: which streams have one
    workspace = 4096 * 1024 * 8  # CUBLAS_WORKSPACE_CONFIG=:4096:8, an H100's default
    rows["workspaces"] = [[f"stream {e.get('stream')}", _site(e.get("frames", []))] for e in end.values()
                          if e["size"] == workspace]
    print(f"  {len(rows['workspaces'])} blocks of a cuBLAS workspace's size live once set up:")
    for stream, site in rows["workspaces"]:
        print(f"    {stream}  {site}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"label": label, **stats, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()

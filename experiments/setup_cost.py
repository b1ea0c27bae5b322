"""What the measured decisions add to a step's setup: ``train_step`` built and first called with timing on and off.

    PYTHONPATH=. python -m experiments.setup_cost --model googlenet --batch 32 [--compile] [--streams 4|auto]
        [--json out.jsonl]
    PYTHONPATH=. python -m experiments.setup_cost --model googlenet --batch 32 --profile [--measure 0]
    PYTHONPATH=. python -m experiments.setup_cost --model googlenet --batch 32 --compile --streams auto --trace
        [--keep-cache]

``--trace`` builds one step in this process (decision cache empty) and prints
where its CUDA-graph work goes: entering and ending each capture, each graph's
first and second replay (synchronized before and after, so the device's time
is its own), ``empty_cache`` calls and the timings as a whole.
``--keep-cache`` does the same with captures that do not empty the
allocator's cache first (``torch.cuda.graph`` does by default).

``--profile`` builds one step in this process under cProfile and prints the
calls that took the most time (cumulative): where setup's seconds go.

The measurements are meant to cost at most 10% of setup time. Each side runs in
a process of its own (inductor's in-process caches would favour the second),
in the order off, on, off, on: the first pair warms inductor's on-disk cache,
so the second pair compares setups that differ only by the timing (a warm
compile, as a user's second run). Timing on uses an empty decision cache, so
every decision is timed, not read back. Setup is the wall time of building
the step and its first call (compile, first-call timings, the step's
decision, warm-up and capture), synchronized; and of the same through
``--calls`` calls, since an unfused step times its programs on its first
calls (:mod:`concur.training.trial`): what those calls cost beyond steady
replays (the slower program's share, a capture after a drop) counts too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _one(args: argparse.Namespace, phases: dict[str, float] | None = None) -> tuple[float, float]:
    """Seconds to build the step and run its first call, and through ``args.calls`` calls, in this process.

    ``phases`` (where given) gets the seconds of building the step alone.
    """
    import torch

    import concur
    from experiments.sweep_models import cuda_setup

    model, batch, loss_fn, opt = cuda_setup(args.model, args.batch)
    streams = args.streams if args.streams == "auto" else int(args.streams)
    torch.cuda.synchronize()
    start = time.perf_counter()
    step = concur.train_step(model, loss_fn, opt(model.parameters()), batch, streams=streams,
                             amp_dtype=torch.bfloat16, compile=args.compile)
    if phases is not None:
        phases["build"] = time.perf_counter() - start
    step(*batch)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    for _ in range(args.calls - 1):
        step(*batch)
    torch.cuda.synchronize()
    return first, time.perf_counter() - start


class _Counted:
    """Seconds and calls of patched functions, by kind; the patches stay for the life of the process."""

    def __init__(self) -> None:
        import collections

        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.counts: collections.Counter = collections.Counter()

    def timed(self, kind: str, fn, *a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.seconds[kind] += time.perf_counter() - start
            self.counts[kind] += 1

    def count(self, owner: object, name: str, kind: str) -> None:
        """Count the calls of ``owner.name`` and their seconds under ``kind``."""
        fn = getattr(owner, name)
        setattr(owner, name, lambda *a, **k: self.timed(kind, fn, *a, **k))

    def decisions_code(self) -> None:
        """Count what the measured decisions run: each graph's first call (its real call, the timing, building the
        pick; with timing off the real call and the predicted pick) and the step's decision."""
        import concur.inductor.first_call as first_call
        import concur.training.step as step

        self.count(first_call.FirstCall, "__call__", "first calls (FirstCall, all of it)")
        self.count(step, "decide_step_streams", "step decision (decide_step_streams)")


def _profile(args: argparse.Namespace) -> None:
    """Print where one setup (this process, decision cache empty) spends its time, by cumulative seconds."""
    import cProfile
    import pstats

    with tempfile.TemporaryDirectory() as cache:
        os.environ["CONCUR_CACHE_DIR"] = cache
        os.environ["CONCUR_MEASURE"] = args.measure
        profile = cProfile.Profile()
        seconds, _ = profile.runcall(_one, args)
    print(f"setup {seconds:.3f} s, CONCUR_MEASURE={args.measure}")
    stats = pstats.Stats(profile).sort_stats("cumulative")
    stats.print_stats(r"concur|graphs\.py|memory\.py|measure|replay|capture|synchron|empty_cache", 45)


def _trace(args: argparse.Namespace) -> None:
    """Print one setup's CUDA-graph work by kind: count and seconds (see the module's docstring)."""
    import collections

    import torch

    import concur.dag.measure as measure

    counted = _Counted()
    seconds, counts, timed = counted.seconds, counted.counts, counted.timed
    replays: collections.Counter = collections.Counter()
    in_enter = [False]
    entered = [0.0]  # when the capture's body began

    enter, exit_, replay, empty = (torch.cuda.graph.__enter__, torch.cuda.graph.__exit__,
                                   torch.cuda.CUDAGraph.replay, torch.cuda.empty_cache)

    def traced_enter(self):
        in_enter[0] = True
        try:
            return timed("capture: enter", enter, self)
        finally:
            in_enter[0] = False
            entered[0] = time.perf_counter()

    def traced_exit(self, *a):
        seconds["capture: body (the program's launches)"] += time.perf_counter() - entered[0]
        counts["capture: body (the program's launches)"] += 1
        return timed("capture: end (instantiate)", exit_, self, *a)

    def traced_empty():
        if in_enter[0] and args.keep_cache:
            return None
        return timed("empty_cache (in capture enter)" if in_enter[0] else "empty_cache (elsewhere)", empty)

    def traced_replay(self):
        n = replays[id(self)]
        replays[id(self)] += 1
        if n > 1:
            return replay(self)
        torch.cuda.synchronize()
        timed(f"replay {n + 1}: host", replay, self)
        return timed(f"replay {n + 1}: device after host", torch.cuda.synchronize)

    torch.cuda.graph.__enter__ = traced_enter
    torch.cuda.graph.__exit__ = traced_exit
    torch.cuda.CUDAGraph.replay = traced_replay
    torch.cuda.empty_cache = traced_empty
    counted.count(measure, "replay_rounds", "timings (replay_rounds, all of it)")
    # replay_rounds less this is the warm-up: one eager call of each program (a forward's first call loads its
    # kernels and runs inductor's autotuning there, which its first real call would do with timing off)
    counted.count(measure, "_timed_rounds", "timings: captures and rounds (_timed_rounds)")
    # what the measured decisions cost in all; the rest of setup runs with timing off as well
    counted.decisions_code()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["CONCUR_CACHE_DIR"] = cache
        os.environ["CONCUR_MEASURE"] = args.measure
        seconds_setup, _ = _one(args)
    print(f"setup {seconds_setup:.3f} s, CONCUR_MEASURE={args.measure}, streams={args.streams}, "
          f"keep_cache={args.keep_cache}")
    for kind in sorted(seconds):
        print(f"  {kind:40s} {counts[kind]:4d} calls {seconds[kind]:8.3f} s")


def _child_run(args: argparse.Namespace) -> dict:
    """One setup in this process, for the parent: its times, its phases and the decisions it took."""
    counted = _Counted()
    counted.decisions_code()
    phases: dict[str, float] = {}
    first, through = _one(args, phases)
    decisions = []
    for path in sorted(Path(os.environ["CONCUR_CACHE_DIR"]).glob("decisions/*.json")):
        result = json.loads(path.read_text()).get("result", {})
        if isinstance(result, dict):
            decisions.append({k: result.get(k) for k in ("what", "keep", "num_streams", "rounds")})
    return {"first": first, "through": through, "build": phases["build"],
            "decisions_code": sum(counted.seconds.values()), "decisions": decisions}


def _child(args: argparse.Namespace, measure: bool, cache: str) -> dict:
    command = [sys.executable, "-m", "experiments.setup_cost", "--child", "--model", args.model, "--batch",
               str(args.batch), "--streams", args.streams, "--calls", str(args.calls)] + \
        (["--compile"] if args.compile else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CONCUR_MEASURE": "1" if measure else "0",
           "CONCUR_CACHE_DIR": cache}
    out = subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="googlenet")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--streams", default="4")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--calls", type=int, default=40,
                    help="also time setup through this many calls: train_step's unfused decision is timed on its "
                         "first calls")
    ap.add_argument("--pairs", type=int, default=1,
                    help="warm (off, on) pairs after the cold pair, alternating; the table gives their medians")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile one setup in this process")
    ap.add_argument("--measure", default="1",
                    help="with --profile or --trace: CONCUR_MEASURE (1 times decisions, 0 not)")
    ap.add_argument("--trace", action="store_true", help="one setup in this process: its CUDA-graph work by kind")
    ap.add_argument("--keep-cache", action="store_true",
                    help="with --trace: captures do not empty the allocator's cache first")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.profile:
        _profile(args)
        return
    if args.trace:
        _trace(args)
        return
    if args.child:
        print(json.dumps(_child_run(args)))
        return
    seconds, through, runs_seen = {}, {}, {}
    runs = [("cold off", False), ("cold on", True)] + \
        [(f"{side} {i}", measure) for i in range(args.pairs) for side, measure in (("off", False), ("on", True))]
    for run, measure in runs:  # warm pairs alternate off and on: a drift of the machine reaches both
        with tempfile.TemporaryDirectory() as cache:  # no decision read back: every one is timed
            seen = runs_seen[run] = _child(args, measure, cache)
        seconds[run], through[run] = seen["first"], seen["through"]
        # each run as it ends: a caller's deadline that cuts the pairs short keeps the runs before it. The build
        # (train_step's constructor) and the decisions' code (each graph's first call, with or without timing, and
        # the step's decision) say in which part a slow setup was slow
        picks = ", ".join(f"{'kept' if d['keep'] else 'dropped'} {d['num_streams']} in {d['rounds']} rounds"
                          for d in seen["decisions"])
        print(f"{run}: setup {seconds[run]:.2f} s, through {args.calls} calls {through[run]:.2f} s; build "
              f"{seen['build']:.2f} s, decisions' code {seen['decisions_code']:.2f} s; decisions: {picks or 'none'}",
              flush=True)
    for side in ("off", "on"):  # the median of the warm runs of each side
        for table in (seconds, through):
            table[side] = statistics.median(table[f"{side} {i}"] for i in range(args.pairs))
    share = seconds["on"] / seconds["off"] - 1
    share_calls = through["on"] / through["off"] - 1
    label = f"{args.model} b{args.batch} {'fused' if args.compile else 'unfused'} streams={args.streams}"
    spread = ", ".join(f"{seconds[f'off {i}']:.2f}/{seconds[f'on {i}']:.2f}" for i in range(args.pairs))
    print(f"{label}: setup {seconds['off']:.2f} s without timing, {seconds['on']:.2f} s with it ({share:+.1%}); "
          f"through {args.calls} calls {through['off']:.2f} / {through['on']:.2f} s ({share_calls:+.1%}); "
          f"cold {seconds['cold off']:.2f} / {seconds['cold on']:.2f} s; medians of {args.pairs} warm pairs "
          f"(off/on: {spread})")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"label": label, "pairs": args.pairs,
                                **{k.replace(' ', '_') + '_s': v for k, v in seconds.items()},
                                **{k.replace(' ', '_') + f'_{args.calls}_calls_s': v for k, v in through.items()},
                                "measurement_share": share, "measurement_share_calls": share_calls,
                                "runs": runs_seen}) + "\n")


if __name__ == "__main__":
    main()

"""A compiled step's memory and speed by which of its graphs run on streams: every graph, the forward graphs,
the backward graphs, none, and the backward taken down as a step short of memory takes it.

    PYTHONPATH=. python -m experiments.plan_memory --out DIR [--networks googlenet inception_v3] [--batch 64]
        [--allocations caller|launching]

Per network, one process (no memory limit): ``train_step(compile=True)``'s
defaults (bf16 autocast, channels-last, SGD with momentum, as
``experiments/memory.py``) are set up, then the step is captured again, in a
pool of its own, with each subset of its graphs' multi-stream programs
switched on (:meth:`concur.inductor.stream_backend.ConcurBackend.running_plans`)
and the rest on inductor's own call, in alternating rounds. A row per
network in DIR/plan_memory.jsonl: each subset's ms per step (CUDA events,
one figure per round) and the reserved MB of its graph pool by stream (the
caching allocator's segments): how much of a multi-stream step's memory
each kind of graph costs, and what its streams give back in speed. This is
what a step under memory pressure chooses between (:mod:`concur.training.capture`
takes the backward graphs' programs down first: on 2 streams, then with
aten's calls on the caller's stream, still on 2, then off; the subsets
"backward on 2" and "backward lean" are those steps, the forward keeping its
streams, and "backward lean on all" the lean step on the step's own streams).
``--allocations launching`` makes each buffer on the stream that first uses
it, as before concur made every buffer a side stream uses first on the
caller's stream (:func:`concur.inductor.wrapper_emit.caller_allocations`):
what that saves.
"""

from __future__ import annotations

import argparse
import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments.memory import breakdown
from experiments.sweep_models import cuda_setup

@dataclass(frozen=True)
class Subset:
    """Which graphs run their multi-stream programs: the forward graphs or not, and the backward graphs' program
    (``BACKWARD_AS_PLACED``: as placed; an int: placed again on that many streams, ``ASKED`` on the step's;
    None: inductor's own call), with aten's calls on the caller's stream where ``lean``, as
    :meth:`ConcurBackend.narrow_plans` takes them down."""

    forward: bool
    backward: int | str | None
    lean: bool = False


BACKWARD_AS_PLACED, ASKED = "as placed", "asked"
SUBSETS: dict[str, Subset] = {
    "all": Subset(True, BACKWARD_AS_PLACED),
    "forward": Subset(True, None),
    "backward": Subset(False, BACKWARD_AS_PLACED),
    "none": Subset(False, None),
    # the steps a step short of memory takes, its forward graphs keeping their streams
    "backward on 2": Subset(True, 2),
    "backward lean": Subset(True, 2, lean=True),
    # lean on the step's streams: what the lean step would hold and give on more than 2
    "backward lean on all": Subset(True, ASKED, lean=True),
}


def run_subset(subset: Subset, plans: list[tuple[Any, Any]], streams: int) -> None:
    """Switch each of ``plans`` (``(CompiledGraphInfo, InstalledPlan)``, the step's as placed) to ``subset``.

    ``streams`` is the stream count the step asked for (an int: with
    ``"auto"`` a graph may have kept fewer): placing a backward again on it
    gives back the program as placed, after a subset changed it.
    """
    for graph, plan in plans:
        if not graph.is_backward or subset.backward is None:
            plan.use_streams(subset.forward and not graph.is_backward)
        elif plan.fewer_streams is None:  # no program to place again: the one placed, or inductor's call
            plan.use_streams(subset.backward == BACKWARD_AS_PLACED)
        else:  # placed again (as placed too: an earlier subset may have changed it); not worth it: inductor's call
            k = subset.backward if isinstance(subset.backward, int) else streams
            if plan.fewer_streams(k, lean=subset.lean) is None:
                plan.use_streams(False)


def pool_by_stream(segments: dict[str, list[float]]) -> dict[str, float]:
    """Reserved MB of the newest graph pool by stream, from :func:`experiments.memory_records.breakdown`'s keys
    (``"poolA.B streamN"``; the default pool is left out)."""
    pools = {key.split()[0] for key in segments if key.startswith("pool")}
    newest = max(pools, key=lambda p: tuple(int(x) for x in p[4:].split(".")), default=None)
    return {key.split()[1]: reserved for key, (reserved, _) in segments.items() if key.split()[0] == newest}


ALLOCATIONS = ("caller", "launching")


def allocate_on_launching_streams() -> None:
    """Make every buffer on the stream of its first launch: no allocation is moved to the caller's stream."""
    from concur.inductor import wrapper_emit

    wrapper_emit.caller_allocations = lambda schedule, statements, storage: {}


def measure(network: str, batch: int, rounds: int, steps: int, allocations: str = "caller") -> dict:
    """Set up the compiled step of ``network`` and return each subset's ms per round and graph pool by stream."""
    import concur

    if allocations == "launching":
        allocate_on_launching_streams()

    model, example, loss_fn, optimizer = cuda_setup(network, batch)
    step = concur.train_step(model, loss_fn, optimizer(model.parameters()), example, amp_dtype=torch.bfloat16,
                             compile=True)
    for _ in range(3):
        step(*example)
    torch.cuda.synchronize()
    plans = [p for backend in step.backends.values() for p in backend.running_plans()]
    streams = step.requested_streams  # train_step's default, 4
    row: dict = {"network": network, "batch": batch, "allocations": allocations, "status": str(step.status),
                 "plans": [{"backward": g.is_backward, "streams": g.num_streams, "launches": g.num_launches}
                           for g, _ in plans],
                 "subsets": {name: {"ms": []} for name in SUBSETS}}
    for _ in range(rounds):
        for name, subset in SUBSETS.items():
            run_subset(subset, plans, streams)
            # a capture of its own in a new pool (the step's internals: this tool measures them)
            step.graphs.clear()
            step._gradients.bound = None
            step._runner.new_pool()
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            for _ in range(5):
                step(*example)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step(*example)
            end.record()
            torch.cuda.synchronize()
            subset = row["subsets"][name]
            subset["ms"].append(start.elapsed_time(end) / steps)
            subset["pool_mb_by_stream"] = pool_by_stream(breakdown())
            subset["pool_mb"] = sum(subset["pool_mb_by_stream"].values())
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the folder of plan_memory.jsonl")
    ap.add_argument("--networks", nargs="+", default=["googlenet", "inception_v3"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the subsets")
    ap.add_argument("--steps", type=int, default=30, help="steps timed per subset and round")
    ap.add_argument("--allocations", choices=ALLOCATIONS, default="caller",
                    help="where the rewritten graphs make the buffers a side stream uses first")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("experiments.plan_memory needs a CUDA device: it captures and times the step")
    args.out.mkdir(parents=True, exist_ok=True)
    for network in args.networks:
        row = measure(network, args.batch, args.rounds, args.steps, args.allocations)
        with open(args.out / "plan_memory.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        for name, subset in row["subsets"].items():
            print(f"{network} b{args.batch} {args.allocations} {name:8s} ms {[round(m, 2) for m in subset['ms']]} "
                  f"pool {subset['pool_mb']:.0f} MB {subset['pool_mb_by_stream']}")


if __name__ == "__main__":
    main()

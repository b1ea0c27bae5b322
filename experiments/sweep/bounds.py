"""The critical-path bound: the forward pass's longest dependency path, with kernel times from a profiler trace.

The forward runs node by node on one stream inside ``concur_node::<name>``
ranges; each kernel is charged to the node that launched it, and those
measured times, as a :class:`concur.dag.cost.MeasuredCost`, cost the plan's
DAG. Its serial time over its longest path is the most any number of
streams could gain on the forward pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODE_RANGE = "concur_node::"  # record_function prefix naming a plan node in a profiler trace


@dataclass(frozen=True)
class CriticalPathBound:
    """Forward-pass DAG with measured kernel times: their sum, the longest path, and coverage."""

    serial_us: float
    critical_path_us: float
    nodes_measured: int
    nodes_total: int

    @property
    def bound_speedup(self) -> float:
        """Serial time over the critical path: no number of streams runs the forward faster."""
        return self.serial_us / self.critical_path_us if self.critical_path_us > 0 else 1.0


def node_times_from_trace(events: list[dict]) -> tuple[dict[str, float], set[str]]:
    """Return (mean GPU µs per plan node per run, nodes seen) from Chrome-trace events.

    A kernel belongs to the node whose ``concur_node::<name>`` CPU range holds
    the runtime call that launched it (linked by ``correlation``), so kernels
    that run later, asynchronously, are still charged to the right node.
    """
    from concur.observe.profile_trace import GPU_CATEGORIES, LAUNCH_CATEGORIES

    ranges, launches, kernels = [], {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if name.startswith(NODE_RANGE) and cat != "gpu_user_annotation":
            ranges.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), name[len(NODE_RANGE):]))
        elif cat in LAUNCH_CATEGORIES and (e.get("args") or {}).get("correlation") is not None:
            launches[e["args"]["correlation"]] = float(e["ts"])
        elif cat in GPU_CATEGORIES:
            kernels.append(e)
    ranges.sort()
    runs: dict[str, int] = {}
    for _, _, name in ranges:
        runs[name] = runs.get(name, 0) + 1
    total: dict[str, float] = {}
    for k in kernels:
        ts = launches.get((k.get("args") or {}).get("correlation"))
        if ts is None:
            continue
        # Innermost range holding the launch: the one that started last before it.
        owner = next((n for s, e, n in reversed(ranges) if s <= ts <= e), None)
        if owner is not None:
            total[owner] = total.get(owner, 0.0) + float(k.get("dur", 0))
    return {n: total.get(n, 0.0) / runs[n] for n in runs}, set(runs)


def critical_path_bound(trace_path: str | os.PathLike, plan: Any) -> CriticalPathBound:
    """Return the critical-path bound of ``plan.dag`` with node costs measured in a profiler trace.

    The trace must hold ``concur_node::<node>`` ranges (see :func:`profile_plan_nodes`).
    Nodes that launched no kernel cost 0. So do nodes absent from the trace,
    rather than a roofline guess, so that the bound is made of measured time
    only; they are counted out of ``nodes_measured``.
    """
    from concur.dag.cost import MeasuredCost, assign_costs
    from concur.observe.profile_trace import load_events
    from schedulers.analysis import critical_path_length

    times, seen = node_times_from_trace(load_events(trace_path))
    dag = plan.dag.copy()
    assign_costs(dag, MeasuredCost({name: times.get(name, 0.0) for name in dag.nodes}))
    return CriticalPathBound(serial_us=sum(cost for _, cost in dag.nodes(data="cost")),
                             critical_path_us=critical_path_length(dag),
                             nodes_measured=len(seen & set(dag.nodes)), nodes_total=dag.number_of_nodes())


def profile_plan_nodes(plan: Any, inputs: tuple, path: Path, amp_dtype: Any, runs: int = 3) -> Path:
    """Run the plan's traced forward op by op, each node in a ``concur_node::`` range; write a trace.

    Serially, on one stream: the point is each node's own kernel time, free of
    contention, which is what the bound assumes.
    """
    import torch
    import torch.fx as fx
    from torch.profiler import ProfilerActivity, profile, record_function

    class Named(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            with record_function(NODE_RANGE + n.name):
                return super().run_node(n)

    interp = Named(plan.traced)

    def forward() -> None:
        with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            interp.run(*inputs)

    forward()  # warm-up: cuDNN autotuning and lazy init stay out of the trace
    torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            forward()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path

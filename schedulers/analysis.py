"""Numbers that say how much concurrency a DAG offers, before and after scheduling."""

from __future__ import annotations

import networkx as nx

from schedulers.critical_path import bottom_levels
from schedulers.schedule import check_dag, schedule, simulate_shared
from schedulers.serial import serial

__all__ = ["critical_path_length", "width", "predicted_speedups", "speedup_predictions"]


def critical_path_length(dag: nx.DiGraph) -> float:
    """Return the cost of the longest path: no number of streams beats it.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> nx.set_node_attributes(dag, {"a": 1, "b": 10, "c": 5, "d": 1}, "cost")
    >>> critical_path_length(dag)
    12.0
    """
    return max(bottom_levels(dag).values(), default=0.0)


def width(dag: nx.DiGraph) -> int:
    """Return the largest number of nodes in one topological generation.

    A generation is the set of nodes at the same depth from the sources
    (`networkx.topological_generations`). This is a cheap lower bound on the
    true width (the largest antichain), which is costlier to compute.

    >>> import networkx as nx
    >>> width(nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]))
    2
    """
    return max((len(g) for g in nx.topological_generations(dag)), default=0)


def predicted_speedups(
    dag: nx.DiGraph, max_streams: int = 8, scheduler: str = "critical_path", *, contention: bool = False,
    **kw: object
) -> dict[int, float]:
    """Return serial makespan / scheduled makespan for 1..max_streams streams.

    With ``contention=True`` the scheduled makespan comes from
    `simulate_shared`: concurrent kernels share the device by their nodes'
    ``share`` attributes instead of each running as if alone, which brings
    the prediction of wide branchy graphs near what is measured (the
    prediction's error is in experiments/RESULTS.md). Extra keywords
    (such as `sync_cost`) go to the scheduler. A graph with no cost at all has
    speedup 1.
    """
    return speedup_predictions(dag, max_streams, scheduler, **kw)["contention" if contention else "ideal"]


def speedup_predictions(
    dag: nx.DiGraph, max_streams: int = 8, scheduler: str = "critical_path", **kw: object
) -> dict[str, dict[int, float]]:
    """Return both of `predicted_speedups`' answers, ``"ideal"`` and ``"contention"``, from one set of schedules."""
    check_dag(dag, max_streams)
    base = serial(dag).makespan
    predictions: dict[str, dict[int, float]] = {"ideal": {}, "contention": {}}
    for k in range(1, max_streams + 1):
        planned = schedule(dag, k, scheduler, **kw)
        for kind, span in (("ideal", planned.makespan), ("contention", simulate_shared(dag, planned))):
            predictions[kind][k] = base / span if span > 0 else 1.0
    return predictions

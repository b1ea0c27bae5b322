"""The baseline: every node on the caller's stream, in original program order.

::

        a
       / \\        order a, b, c, d, all on stream 0: no waits, and a
      b   c       makespan equal to the sum of the costs
       \\ /
        d

The order is the topological order that follows node insertion order wherever
the edges allow (for an fx graph, the order of `graph.nodes`), so `serial` is
what eager PyTorch would do, and the yardstick every speedup is measured by.
"""

from __future__ import annotations

import networkx as nx

from schedulers.schedule import Schedule, build_schedule, check_dag, insertion_order, register

__all__ = ["serial"]


@register
def serial(dag: nx.DiGraph, num_streams: int = 1, **kw: object) -> Schedule:
    """Return the one-stream schedule in original program order.

    `num_streams` is accepted for a uniform signature and ignored.

    >>> import networkx as nx
    >>> s = serial(nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]))
    >>> s.order, s.waits, s.num_streams
    (('a', 'b', 'c', 'd'), (), 1)
    """
    check_dag(dag, max(num_streams, 1))
    order = insertion_order(dag)
    return build_schedule(dag, order, {v: 0 for v in order}, "serial")

"""Chain-keeping fork scheduler: every branch of a fork gets a stream of its own.

Nodes are visited in original program order. A chain continues on its
producer's stream; at a fork the first successor keeps the parent's stream and
each further successor opens a branch; a join goes back to the stream of its
heaviest predecessor::

              a                 a, b1, d: stream 0 (b1 is a's first successor)
           /  |  \\              b2: stream 1, b3: stream 2 (new branches)
         b1   b2   b3           d: stream of the heaviest of b1, b2, b3
           \\  |  /
              d

A new branch goes to the least loaded stream other than the parent's (load =
summed cost of the nodes placed so far, then number of nodes, then lowest
index), rather than round-robin, so that with fewer streams than branches the
heavy branches spread out. A source node other than the first opens a branch
too, so independent chains from different inputs run side by side.
"Heaviest" predecessor means the one with the costliest path from a source
(its top level); ties go to the lowest stream, which pulls joins back towards
the caller's stream.

Nodes marked ``trivial`` are joined to a neighbour first, as in
`critical_path` (`schedulers.attach_trivial`).

Unlike `critical_path`, `fork` ignores how long each branch takes; it is the
simple, predictable structural baseline.
"""

from __future__ import annotations

from collections.abc import Hashable

import networkx as nx

from schedulers.coarsen import with_trivial_attached
from schedulers.schedule import (
    Schedule,
    build_schedule,
    check_dag,
    insertion_order,
    node_cost,
    register,
)

__all__ = ["fork"]


@register
@with_trivial_attached
def fork(dag: nx.DiGraph, num_streams: int, sync_cost: float = 1.0, **kw: object) -> Schedule:
    """Return a schedule that keeps chains on one stream and gives each forked branch its own.

    `sync_cost` only enters the predicted makespan; it does not change the
    assignment.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> s = fork(dag, num_streams=2)
    >>> dict(s.stream), s.waits
    ({'a': 0, 'b': 0, 'c': 1, 'd': 0}, (Wait(producer='a', consumer='c'), Wait(producer='c', consumer='d')))
    """
    check_dag(dag, num_streams)
    index = {v: i for i, v in enumerate(dag.nodes)}
    order = insertion_order(dag)
    first_successor = {
        u: min(dag.successors(u), key=index.__getitem__) for u in dag.nodes if dag.out_degree(u)
    }
    top: dict[Hashable, float] = {}
    load = [0.0] * num_streams
    count = [0] * num_streams
    stream: dict[Hashable, int] = {}

    def branch(parent: int) -> int:
        others = [t for t in range(num_streams) if t != parent] or [parent]
        return min(others, key=lambda t: (load[t], count[t], t))

    for v in order:
        preds = list(dag.predecessors(v))
        if len(preds) > 1:
            t = stream[max(preds, key=lambda u: (top[u], -stream[u]))]
        elif preds and first_successor[preds[0]] == v:
            t = stream[preds[0]]
        elif preds:
            t = branch(stream[preds[0]])
        else:
            t = 0 if not stream else branch(0)
        stream[v] = t
        top[v] = node_cost(dag, v) + max((top[u] for u in preds), default=0.0)
        load[t] += node_cost(dag, v)
        count[t] += 1
    return build_schedule(dag, order, stream, "fork", sync_cost)

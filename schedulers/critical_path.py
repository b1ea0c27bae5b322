"""List scheduling by critical path: heaviest remaining work first, earliest finish wins.

The priority of a node is its *bottom level*: the cost of the longest path
from it to a sink, its own cost included. In the diamond below (costs in
brackets) a, b and c lie on paths of 12, so they go first, d last::

          a [1]           bottom levels: a 12, b 11, c 11, d 1
         /     \\
     b [10]   c [10]      2 streams: a, b on stream 0; c on stream 1
         \\     /          (finishes at 11, not 21); d on stream 0
          d [1]           makespan 12 instead of 22

Repeatedly the ready node (all predecessors placed) of highest priority is
placed on the stream where it would *finish* first: start when the stream is
free and every predecessor has finished, plus `sync_cost` if any predecessor
is on another stream (the wait it will need). Ties go to a stream holding the
predecessor that finishes last (so chains and zero-cost nodes stay with their
producer when moving gains nothing), then to the lowest stream index. The
issue order is the order of placement; the waits are `minimal_waits`.

Nodes marked ``trivial`` (no arithmetic: a view, an identity, a step
counter) are first joined to a neighbour (`schedulers.attach_trivial`), so
none gets a stream or a wait of its own.

With ``sync_cost=0`` the predicted makespan never exceeds the serial one: each
placement finishes no later than the latest finish so far plus its own cost.

Given ``memory_budget`` (bytes; nodes carry ``bytes`` and ``held``, see
`schedulers.stream_memory`), a node goes only to a stream where the sum of the
streams' peaks of live bytes stays within the budget; where none does, to
the stream that adds the least. Far from the program's peak of memory every
stream fits, so the budget limits concurrency only near it. With
``training_memory=True`` the budget also covers a training step's backward
(held outputs made on a side stream count again: `schedulers.stream_memory`),
which keeps large saved activations on the caller's stream and lets side
streams run the branches whose saved activations are small.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import networkx as nx

from schedulers.coarsen import with_trivial_attached
from schedulers.stream_memory import MemoryTracker
from schedulers.schedule import Schedule, build_schedule, check_dag, node_cost, register

__all__ = ["critical_path", "bottom_levels"]


def bottom_levels(dag: nx.DiGraph) -> dict[Hashable, float]:
    """Return, per node, the cost of the longest path from it to a sink, its own cost included.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b"), ("b", "c")])
    >>> nx.set_node_attributes(dag, {"a": 1.0, "b": 2.0, "c": 3.0}, "cost")
    >>> bottom_levels(dag)
    {'c': 3.0, 'b': 5.0, 'a': 6.0}
    """
    level: dict[Hashable, float] = {}
    for v in reversed(list(nx.topological_sort(dag))):
        level[v] = node_cost(dag, v) + max((level[s] for s in dag.successors(v)), default=0.0)
    return level


@register
@with_trivial_attached
def critical_path(
    dag: nx.DiGraph, num_streams: int, sync_cost: float = 1.0, memory_budget: int | None = None,
    training_memory: bool = False, **kw: object
) -> Schedule:
    """Return a list schedule that runs the longest remaining path first, each node where it finishes first.

    >>> import networkx as nx
    >>> dag = nx.DiGraph()
    >>> dag.add_nodes_from([("a", {"cost": 1}), ("b", {"cost": 10}),
    ...                     ("c", {"cost": 10}), ("d", {"cost": 1})])
    >>> dag.add_edges_from([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> s = critical_path(dag, num_streams=2, sync_cost=0.0)
    >>> s.order, dict(s.stream)
    (('a', 'b', 'c', 'd'), {'a': 0, 'b': 0, 'c': 1, 'd': 0})
    >>> s.waits
    (Wait(producer='a', consumer='c'), Wait(producer='c', consumer='d'))
    >>> s.makespan
    12.0

    Two branches whose outputs do not all fit side by side (4 bytes each,
    `schedulers.stream_memory`): on two streams they need 16 bytes, on one 12;
    within 12, branch c stays on stream 0.

    >>> from schedulers.stream_memory import peak_bytes
    >>> dag = nx.DiGraph([("a", "b1"), ("b1", "b2"), ("b2", "d"), ("a", "c1"), ("c1", "c2"), ("c2", "d")])
    >>> nx.set_node_attributes(dag, {"a": 1, "b1": 5, "b2": 5, "c1": 5, "c2": 5, "d": 1}, "cost")
    >>> nx.set_node_attributes(dag, 4, "bytes")
    >>> free = critical_path(dag, 2, sync_cost=0.0)
    >>> kept = critical_path(dag, 2, sync_cost=0.0, memory_budget=12)
    >>> [free.stream[v] for v in ("c1", "c2")], [kept.stream[v] for v in ("c1", "c2")]
    ([1, 1], [0, 0])
    >>> peak_bytes(dag, free.order, free.stream), peak_bytes(dag, kept.order, kept.stream)
    (16, 12)

    With c1 and c2 saved for backward (``held``) one stream needs 16 bytes, and so does the program with
    branch c on stream 1 (8 + 8). For training those 8 bytes count again (the caller's stream cannot reuse
    them in backward): within 16 the branch stays on stream 0; within 24 it goes to stream 1.

    >>> nx.set_node_attributes(dag, {"c1": True, "c2": True}, "held")
    >>> forward = critical_path(dag, 2, sync_cost=0.0, memory_budget=16)
    >>> training = critical_path(dag, 2, sync_cost=0.0, memory_budget=16, training_memory=True)
    >>> roomy = critical_path(dag, 2, sync_cost=0.0, memory_budget=24, training_memory=True)
    >>> [[s.stream[v] for v in ("c1", "c2")] for s in (forward, training, roomy)]
    [[1, 1], [0, 0], [1, 1]]
    """
    check_dag(dag, num_streams)
    index = {v: i for i, v in enumerate(dag.nodes)}
    priority = bottom_levels(dag)
    missing = {v: dag.in_degree(v) for v in dag.nodes}
    # The insertion index is unique, so heap entries never compare the nodes themselves.
    ready = [(-priority[v], index[v], v) for v in dag.nodes if missing[v] == 0]
    heapq.heapify(ready)

    memory = MemoryTracker(dag, num_streams, training_memory) if memory_budget is not None else None
    free = [0.0] * num_streams
    finish: dict[Hashable, float] = {}
    stream: dict[Hashable, int] = {}
    order: list[Hashable] = []
    while ready:
        _, _, v = heapq.heappop(ready)
        preds = list(dag.predecessors(v))
        inputs_done = max((finish[u] for u in preds), default=0.0)
        last = max(((finish[u], node_cost(dag, u)) for u in preds), default=None)
        home = {stream[u] for u in preds if (finish[u], node_cost(dag, u)) == last}

        def finish_on(t: int) -> float:
            cross = any(stream[u] != t for u in preds)
            return max(free[t], inputs_done) + (sync_cost if cross else 0.0) + node_cost(dag, v)

        candidates = list(range(num_streams))
        if memory is not None:
            fits = [t for t in candidates if memory.fits_if(v, t, memory_budget)]
            candidates = fits or [min(candidates, key=lambda t: (memory.total_if(v, t), t != 0, t))]
            memory.issue(v, t := min(candidates, key=lambda t: (finish_on(t), t not in home, t)))
        else:
            t = min(candidates, key=lambda t: (finish_on(t), t not in home, t))
        finish[v] = free[t] = finish_on(t)
        stream[v] = t
        order.append(v)
        for s in dag.successors(v):
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(ready, (-priority[s], index[s], s))
    return build_schedule(dag, order, stream, "critical_path", sync_cost)

"""Coarsen a DAG of small ops into branches before scheduling, and expand the schedule back.

After fusion a graph holds hundreds of cheap ops around a few heavy kernels.
Scheduled one by one they scatter over streams, and every scatter costs an
event, while the concurrency worth having is between *branches*. So nodes are
grouped into clusters, walked in program order:

* a node whose input comes from a **fork** starts a new cluster: a fork is a
  value whose consumers lead to different heavy work, the start of parallel
  branches (each consumer's *branch* is the set of the first heavy nodes it
  reaches; a fork has two different non-empty ones);
* a node whose inputs all come from one cluster (and from no fork) continues
  it, so a branch stays one cluster;
* a join (inputs from several clusters) starts a new cluster: were it to
  continue one branch, that whole branch would have to wait for the others;
* views (``view`` attribute) cost nothing and go with their input; a view or
  cheap op with no inputs goes with its only consumer;
* ops that do no arithmetic (``trivial`` attribute: a ``getitem``, an
  identity, BatchNorm's ``num_batches_tracked += 1``) are treated as views,
  and a cluster left holding only such ops joins a neighbour
  (:func:`attach_trivial`), so none of them costs a stream switch.

::

        x            x is a fork: a1 and b1 are independent consumers
       / \\
     a1   b1         clusters: {x}  {a1, a2}  {b1}  {c}
      |    |
     a2    |
       \\  /
        c

Consumers that meet again before any heavy node (BatchNorm's mean and
variance, both feeding its normalisation) are one branch, and a consumer
leading to no heavy node (BatchNorm's running-statistics update: a few tiny
pointwise ops ending in a buffer write) is none. Nodes are ``heavy`` unless
marked otherwise; a compiler marks pointwise work as not heavy.

>>> import networkx as nx
>>> dag = nx.DiGraph([("x", "a1"), ("a1", "a2"), ("x", "b1"), ("a2", "c"), ("b1", "c")])
>>> nx.set_node_attributes(dag, {"a1": 2.0, "a2": 2.0, "b1": 1.0}, "cost")
>>> sorted(map(sorted, coarsen(dag).members.values()))
[['a1', 'a2'], ['b1'], ['c'], ['x']]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import networkx as nx

from schedulers.schedule import Schedule, build_schedule, insertion_order, node_cost

__all__ = ["Coarsened", "attach_trivial", "coarsen", "expand", "merge_small", "with_trivial_attached"]


@dataclass(frozen=True)
class Coarsened:
    """A DAG of clusters (node = cluster id, ``cost`` = sum of members) and each cluster's members."""

    dag: nx.DiGraph
    members: dict[int, tuple[Hashable, ...]]  # in topological order of the original DAG
    cluster_of: dict[Hashable, int]


def coarsen(dag: nx.DiGraph, view: str = "view", min_cost: float = 0.0, heavy: str = "heavy",
            trivial: str = "trivial") -> Coarsened:
    """Return ``dag`` contracted into branch clusters (see the module docstring).

    Clusters of ``trivial`` ops only join a neighbour (:func:`attach_trivial`);
    clusters cheaper than ``min_cost`` (an event's worth of work) are then
    merged into a neighbour (:func:`merge_small`).
    """
    is_view = {v: bool(dag.nodes[v].get(view, False) or dag.nodes[v].get(trivial, False)) for v in dag}
    is_heavy = {v: bool(dag.nodes[v].get(heavy, True)) for v in dag}

    def origin(u: Hashable) -> Hashable:  # the value a view chain reads
        while is_view[u] and dag.in_degree(u) == 1:
            u = next(iter(dag.predecessors(u)))
        return u

    def consumers(u: Hashable) -> set[Hashable]:  # non-view consumers, through views
        found, stack = set(), list(dag.successors(u))
        while stack:
            c = stack.pop()
            if is_view[c]:
                stack.extend(dag.successors(c))
            else:
                found.add(c)
        return found

    def nearest_heavy(c: Hashable) -> frozenset:
        """The heavy nodes reachable from c without passing another heavy node (c itself if heavy)."""
        found, seen, stack = set(), {c}, [c]
        while stack:
            u = stack.pop()
            if is_heavy[u]:
                found.add(u)
                continue
            for w in dag.successors(u):
                if w not in seen:
                    seen.add(w)
                    stack.append(w)
        return frozenset(found)

    forks: dict[Hashable, bool] = {}

    def is_fork(u: Hashable) -> bool:
        if u not in forks:
            cs = consumers(u)
            branches = {nearest_heavy(c) for c in cs} - {frozenset()} if len(cs) > 1 else set()
            forks[u] = len(branches) > 1
        return forks[u]

    cluster_of: dict[Hashable, int] = {}
    members: dict[int, list[Hashable]] = {}
    deferred: list[Hashable] = []

    def put(v: Hashable, c: int) -> None:
        members.setdefault(c, []).append(v)
        cluster_of[v] = c

    def pull_deferred(v: Hashable, c: int) -> None:
        """Place the deferred sources feeding ``v`` (recursively) into cluster ``c``, before v."""
        for u in dag.predecessors(v):
            if u in deferred:
                deferred.remove(u)
                pull_deferred(u, c)
                put(u, c)

    for v in insertion_order(dag):
        preds = list(dag.predecessors(v))
        free = is_view[v] or node_cost(dag, v) == 0
        if all(u in deferred for u in preds) and dag.out_degree(v) == 1 and free:
            deferred.append(v)  # placed with its consumer
            continue
        placed = [u for u in preds if u in cluster_of]
        clusters = {cluster_of[u] for u in placed}
        if len(clusters) == 1 and (is_view[v] or not any(is_fork(origin(u)) for u in placed)):
            target = clusters.pop()  # a chain goes on; its only entry stays its first member
        else:
            target = len(members)  # a branch head, a join, or a source
        pull_deferred(v, target)
        put(v, target)
    for d in deferred:  # a source whose consumer never came (cannot happen in a DAG; kept for safety)
        put(d, len(members))
    attached = attach_trivial(dag, {c: tuple(vs) for c, vs in members.items()}, trivial)
    return merge_small(dag, attached.members, min_cost)


def attach_trivial(dag: nx.DiGraph, members: dict[int, tuple] | None = None, trivial: str = "trivial"
                   ) -> Coarsened:
    """Return ``members`` (default: one cluster per node) with each cluster of ``trivial`` ops joined to a neighbour.

    An op that does no arithmetic (a view, a ``getitem``, an identity, a
    one-element counter update) is worth no stream of its own: on a stream
    apart it costs an event wait and is predicted to overlap work it cannot
    speed up, since its time is the CPU's launch. A cluster holding only such
    ops therefore joins, in program order:

    * the cluster of its latest producer (the one issued last), when that adds
      no cycle;
    * else, with no producer, the cluster of its only consumer;
    * else, with neither (BatchNorm's ``num_batches_tracked.add_(1)``), the
      cluster of the op just before it in program order, which adds no
      dependency at all.

    A trivial source feeding several clusters stays alone: joining any one of
    them would order the others after it.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("x", "a"), ("x", "i"), ("i", "b"), ("a", "c"), ("b", "c")])
    >>> dag.add_node("n", trivial=True); dag.nodes["i"]["trivial"] = True
    >>> sorted(map(sorted, attach_trivial(dag).members.values()))
    [['a'], ['b'], ['c', 'n'], ['i', 'x']]
    """
    order = insertion_order(dag)
    position = {v: i for i, v in enumerate(order)}
    if members is None:
        members = {i: (v,) for i, v in enumerate(order)}
    groups = {c: list(vs) for c, vs in members.items()}
    cluster_of = {v: c for c, vs in groups.items() for v in vs}
    coarse = nx.DiGraph()
    coarse.add_nodes_from(groups)
    coarse.add_edges_from((cluster_of[u], cluster_of[v]) for u, v in dag.edges if cluster_of[u] != cluster_of[v])
    candidates = sorted((c for c, vs in groups.items() if vs and all(dag.nodes[v].get(trivial, False) for v in vs)),
                        key=lambda c: min(position[v] for v in groups[c]))
    for c in candidates:
        preds = {cluster_of[u] for v in groups[c] for u in dag.predecessors(v)} - {c}
        succs = set(coarse.successors(c))
        if preds:
            latest = max((u for v in groups[c] for u in dag.predecessors(v) if cluster_of[u] != c),
                         key=position.__getitem__)
            into = cluster_of[latest]
            if len(preds) > 1 and not _merge_keeps_acyclic(coarse, into, c):
                continue
        elif len(succs) == 1:
            into = succs.pop()  # no producer: joining the one consumer adds no edge
        elif not succs:
            first = min(position[v] for v in groups[c])
            if len(groups) < 2:
                continue
            before = [v for v in order[:first] if cluster_of[v] != c]
            into = cluster_of[before[-1]] if before else cluster_of[next(v for v in order if cluster_of[v] != c)]
        else:
            continue
        for v in groups.pop(c):
            groups[into].append(v)
            cluster_of[v] = into
        coarse = nx.contracted_nodes(coarse, into, c, self_loops=False, copy=False)
    return _cluster_dag(dag, {c: tuple(vs) for c, vs in groups.items()})


def with_trivial_attached(scheduler: Callable[..., Schedule]) -> Callable[..., Schedule]:
    """Wrap a scheduler so ``trivial`` ops go on the stream of the cluster :func:`attach_trivial` gives them.

    The wrapped scheduler sees the contracted DAG (a node per cluster, cost
    the members' sum) and its schedule is expanded back, with its own
    ``sync_cost``; a DAG with no trivial op is scheduled as it is.
    """

    @functools.wraps(scheduler)
    def wrapped(dag: nx.DiGraph, num_streams: int, *args: object, **kw: object) -> Schedule:
        if not any(trivial for _, trivial in dag.nodes(data="trivial")):
            return scheduler(dag, num_streams, *args, **kw)
        coarse = attach_trivial(dag)
        planned = scheduler(coarse.dag, num_streams, *args, **kw)
        order = [v for c in planned.order for v in coarse.members[c]]
        stream = {v: planned.stream[coarse.cluster_of[v]] for v in order}
        return build_schedule(dag, order, stream, planned.scheduler, planned.sync_cost)

    return wrapped


def _cluster_dag(dag: nx.DiGraph, members: dict[int, tuple]) -> Coarsened:
    position = {v: i for i, v in enumerate(insertion_order(dag))}
    ordered = sorted(members.values(), key=lambda vs: position[vs[0]])
    members = {c: tuple(sorted(vs, key=position.__getitem__)) for c, vs in enumerate(ordered)}
    cluster_of = {v: c for c, vs in members.items() for v in vs}
    coarse = nx.DiGraph()
    for c, vs in members.items():  # inserted in program order: schedulers read it as such
        # a cluster holds its members' outputs (a member's freed inside the cluster is counted whole)
        coarse.add_node(c, cost=sum(node_cost(dag, v) for v in vs),
                        bytes=sum(int(dag.nodes[v].get("bytes") or 0) for v in vs),
                        held=any(dag.nodes[v].get("held", False) for v in vs))
    coarse.add_edges_from((cluster_of[u], cluster_of[v]) for u, v in dag.edges
                          if cluster_of[u] != cluster_of[v])
    return Coarsened(coarse, members, cluster_of)


def _merge_keeps_acyclic(coarse: nx.DiGraph, a: int, b: int) -> bool:
    """Return True if contracting the edge a -> b leaves the graph acyclic (no other a ~> b path)."""
    coarse.remove_edge(a, b)
    try:
        return not nx.has_path(coarse, a, b)
    finally:
        coarse.add_edge(a, b)


def merge_small(dag: nx.DiGraph, members: dict[int, tuple], min_cost: float) -> Coarsened:
    """Merge clusters cheaper than ``min_cost`` into a successor (else a predecessor), keeping a DAG.

    A cluster worth less than an event wait is not worth a stream of its
    own: a recomputed normalisation in a backward graph, a gradient sum.
    Consumers are preferred, so such work runs just before the branch that
    needs it. A merge is made only if it adds no dependency to the cluster
    that absorbs it (the small cluster's inputs are already among that
    cluster's) and leaves no other path between the two (no cycle), so
    merging never serialises branches that could run side by side.
    """
    result = _cluster_dag(dag, members)
    if min_cost <= 0:
        return result
    coarse, members = result.dag.copy(), {c: list(vs) for c, vs in result.members.items()}
    stuck: set[int] = set()
    while True:
        small = [c for c in coarse if c not in stuck and coarse.nodes[c]["cost"] < min_cost]
        if not small:
            break
        a = min(small, key=lambda c: (coarse.nodes[c]["cost"], c))
        inputs = set(coarse.predecessors(a))
        edges = [(a, b) for b in coarse.successors(a) if inputs <= set(coarse.predecessors(b))]
        edges += [(p, a) for p in inputs if inputs <= {p, *coarse.predecessors(p)}]
        valid = [(u, v) for u, v in edges if _merge_keeps_acyclic(coarse, u, v)]
        if not valid and coarse.degree(a) == 0 and len(coarse) > 1:
            # unconnected (BatchNorm's num_batches_tracked + 1): joining any cluster adds no dependency
            valid = [(min(c for c in coarse if c != a), a)]
        if not valid:
            stuck.add(a)
            continue
        u, v = valid[0]
        keep, gone = (v, u) if u == a else (u, v)
        members[keep] += members.pop(gone)
        coarse.nodes[keep]["cost"] += coarse.nodes[gone]["cost"]
        coarse = nx.contracted_nodes(coarse, keep, gone, self_loops=False, copy=False)
    return _cluster_dag(dag, {c: tuple(vs) for c, vs in members.items()})


def expand(dag: nx.DiGraph, coarsened: Coarsened, cluster_schedule: Schedule) -> Schedule:
    """Return the node-level schedule: each cluster's members in order, on the cluster's stream."""
    order = [v for c in cluster_schedule.order for v in coarsened.members[c]]
    stream = {v: cluster_schedule.stream[coarsened.cluster_of[v]] for v in order}
    return build_schedule(dag, order, stream, cluster_schedule.scheduler)

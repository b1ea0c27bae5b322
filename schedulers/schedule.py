"""The `Schedule` a scheduler returns, and the checks and predictions made on it.

A schedule answers two questions for a DAG of kernels: on which stream does
each node run, and in which order does the one CPU thread issue them. The
waits between streams follow from those two answers, so they are computed
here, once, for every scheduler::

        a            a: stream 0
       / \\           b: stream 0   (same stream as a: ordered for free)
      b   c          c: stream 1   needs a  -> Wait(a, c)
       \\ /           d: stream 0   needs c  -> Wait(c, d); b is ordered for free
        d

Execution model (what the runtime does with a schedule). The CPU walks
`order`; for a node v on stream t it makes t wait on the event of every
`Wait(p, v)`, issues v on t, and, if v is some wait's producer, records an
event on t right after v. Work on one stream runs in issue order. Every stream
first waits on the caller's stream (stream 0) and the caller finally waits on
every stream, so graph inputs and outputs need no waits.

Happens-before is tracked with vector clocks: ``clock[t][s]`` is how many
nodes of stream s stream t knows to be finished. Issuing v on t advances
``clock[t][t]``; an event recorded after p snapshots p's stream's clock; a
wait merges that snapshot into the waiting stream's clock. A dependency u -> v
holds when u is issued before v and, at v's start, v's stream knows u's
position on u's stream to be finished.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import networkx as nx

__all__ = [
    "Replay",
    "Wait",
    "replay",
    "schedule_steps",
    "Schedule",
    "minimal_waits",
    "simulate",
    "simulate_shared",
    "validate",
    "build_schedule",
    "check_dag",
    "node_cost",
    "insertion_order",
    "SCHEDULERS",
    "register",
    "schedule",
]


@dataclass(frozen=True)
class Wait:
    """Stream of `consumer` waits on the event recorded right after `producer`."""

    producer: Hashable
    consumer: Hashable


@dataclass(frozen=True)
class Schedule:
    """Stream assignment, issue order and cross-stream waits for one DAG.

    `num_streams` is the number of streams actually used (max index + 1, at
    least 1); stream 0 is the caller's stream. `makespan` is `simulate`'s
    prediction, in the DAG's cost units.
    """

    order: tuple
    stream: Mapping[Hashable, int] = field(hash=False)
    waits: tuple[Wait, ...]
    num_streams: int
    scheduler: str
    makespan: float
    sync_cost: float = 0.0  # per wait, in cost units, as `makespan` was simulated

    def __post_init__(self) -> None:
        if not isinstance(self.stream, MappingProxyType):
            object.__setattr__(self, "stream", MappingProxyType(dict(self.stream)))

    @property
    def placement(self) -> tuple[tuple, tuple]:
        """Return the issue order and the (node, stream) pairs, sorted: what two schedules that run alike share
        (their waits follow from it; their makespans may have been simulated at different sync costs)."""
        return tuple(self.order), tuple(sorted(self.stream.items(), key=repr))

    @property
    def streams_used(self) -> tuple[int, ...]:
        """Return the sorted stream indices that run at least one node."""
        return tuple(sorted(set(self.stream.values())))

    def nodes_on(self, stream: int) -> tuple:
        """Return the nodes of `stream`, in issue order."""
        return tuple(v for v in self.order if self.stream[v] == stream)

    def waits_into(self, node: Hashable) -> tuple[Wait, ...]:
        """Return the waits whose consumer is `node`."""
        return self._waits_by_consumer.get(node, ())

    def producers(self) -> frozenset:
        """Return the nodes after which an event must be recorded."""
        return frozenset(w.producer for w in self.waits)

    @cached_property
    def _waits_by_consumer(self) -> dict[Hashable, tuple[Wait, ...]]:
        by: dict[Hashable, list[Wait]] = defaultdict(list)
        for w in self.waits:
            by[w.consumer].append(w)
        return {v: tuple(ws) for v, ws in by.items()}


# --------------------------------------------------------------------------
# Input helpers shared by the schedulers.


def node_cost(dag: nx.DiGraph, v: Hashable) -> float:
    """Return the `cost` attribute of `v` as a float (0 when missing)."""
    return float(dag.nodes[v].get("cost") or 0.0)


def insertion_order(dag: nx.DiGraph) -> list:
    """Return a topological order that follows node insertion order where it can.

    This is the "original program order": for an fx graph, the order of
    `graph.nodes`.
    """
    index = {v: i for i, v in enumerate(dag.nodes)}
    return list(nx.lexicographical_topological_sort(dag, key=index.__getitem__))


def check_dag(dag: nx.DiGraph, num_streams: int) -> None:
    """Raise `ValueError` unless `dag` is acyclic with valid costs and `num_streams >= 1`."""
    if not isinstance(num_streams, int) or num_streams < 1:
        raise ValueError(f"num_streams must be an int >= 1, got {num_streams!r}")
    if not nx.is_directed_acyclic_graph(dag):
        cycle = " -> ".join(repr(u) for u, _ in nx.find_cycle(dag))
        raise ValueError(
            f"the graph has a cycle ({cycle} -> ...); a schedule needs a DAG: "
            "drop the edge that closes the cycle"
        )
    for v in dag.nodes:
        c = node_cost(dag, v)
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"node {v!r} has cost {c!r}; costs must be finite and >= 0")


# --------------------------------------------------------------------------
# Vector clocks.


@dataclass(frozen=True)
class Replay:
    """What `replay` found walking an issue program: problems, and which waits added knowledge."""

    unsatisfied: tuple[tuple[Hashable, Hashable], ...]  # dependencies (u, v) not known finished at v
    problems: tuple[str, ...]  # one sentence each, unsatisfied dependencies included
    needed: frozenset[tuple[Hashable, Hashable]]  # (event, node): the wait told node's stream about the
    # event's producer, which neither the stream's own history nor the node's other waits did


def replay(
    dag: nx.DiGraph,
    steps: Iterable[tuple[str, Hashable]],
    free: Iterable[Hashable] = (),
) -> Replay:
    """Replay an issue program with vector clocks: the one checker for schedules and generated code.

    `steps` are ``("switch", stream)``, ``("wait", event)``, ``("issue", node)``
    and ``("record", event)``, in the order the CPU runs them: a schedule
    (`validate`), concur's generated fx code and a rewritten inductor wrapper
    are each checked by turning them into this form. A record snapshots its
    stream's clock (the event's producer is the node last issued on that
    stream); a wait merges the snapshot into the waiting stream. Every
    dependency of a node must be known finished on its stream when it is
    issued. Nodes in `free` do no device work and need no inputs (a view of a
    parameter): they are finished as soon as issued. Steps naming a node not in
    `dag` are reported, as are nodes issued twice or never.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b")])
    >>> ok = [("issue", "a"), ("record", 0), ("switch", 1), ("wait", 0), ("issue", "b")]
    >>> replay(dag, ok).problems
    ()
    >>> replay(dag, [s for s in ok if s[0] != "wait"]).problems
    ("dependency 'a' -> 'b' is not ordered: stream 1 does not wait for 'a' on stream 0",)
    """
    steps = list(steps)
    free = set(free)
    n = max([0, *(a + 1 for op, a in steps if op == "switch")])
    n = max(n, 1)
    clock = [[0] * n for _ in range(n)]
    current = 0
    where: dict[Hashable, tuple[int, int]] = {}  # node -> (stream, 1-based position; 0 if free)
    last_on = [None] * n  # node last issued on each stream
    events: dict[Hashable, tuple[tuple[int, ...], Hashable]] = {}  # event -> (snapshot, producer)
    pending: list[list[tuple[Hashable, tuple[int, ...], Hashable]]] = [[] for _ in range(n)]
    unsatisfied: list[tuple[Hashable, Hashable]] = []
    problems: list[str] = []
    needed: set[tuple[Hashable, Hashable]] = set()
    for op, arg in steps:
        if op == "switch":
            current = arg
        elif op == "record":
            events[arg] = (tuple(clock[current]), last_on[current])
        elif op == "wait":
            if arg not in events:
                # a wait on an event not yet recorded is a no-op on CUDA: it adds nothing
                problems.append(f"wait on event {arg!r} before it is recorded")
                continue
            pending[current].append((arg, *events[arg]))
        elif op == "issue":
            v, c = arg, clock[current]
            if v not in dag:
                problems.append(f"{v!r} is issued but not in the graph")
                continue
            if v in where:
                problems.append(f"{v!r} is issued twice")
            incoming = pending[current]
            pending[current] = []
            for j, (event, snap, producer) in enumerate(incoming):
                if producer is None or producer not in where:
                    continue
                p, seq = where[producer]
                others = max((o[p] for k, (_, o, _) in enumerate(incoming) if k != j), default=0)
                if max(c[p], others) < seq:
                    needed.add((event, v))
            for _, snap, _ in incoming:
                for i in range(n):
                    if snap[i] > c[i]:
                        c[i] = snap[i]
            if v in free:
                where[v] = (current, 0)
                continue
            for u in dag.predecessors(v):
                if u not in where or c[where[u][0]] < where[u][1]:
                    unsatisfied.append((u, v))
                    s = where[u][0] if u in where else "?"
                    problems.append(f"dependency {u!r} -> {v!r} is not ordered: stream {current} does not wait "
                                    f"for {u!r} on stream {s}")
            c[current] += 1
            where[v] = (current, c[current])
            last_on[current] = v
        else:
            raise ValueError(f"unknown step {op!r}")
    missing = [v for v in dag.nodes if v not in where]
    if missing:
        problems.append(f"never issued: {missing[:5]!r}")
    return Replay(tuple(unsatisfied), tuple(problems), frozenset(needed))


def schedule_steps(order: Sequence, stream: Mapping[Hashable, int], waits: Iterable[Wait]
                   ) -> list[tuple[str, Hashable]]:
    """Return the issue program of a schedule for `replay`: the execution model above, events named by producer."""
    into: dict[Hashable, list[Wait]] = defaultdict(list)
    producers = set()
    for w in waits:
        into[w.consumer].append(w)
        producers.add(w.producer)
    steps: list[tuple[str, Hashable]] = []
    current = 0
    for v in order:
        if stream[v] != current:
            current = stream[v]
            steps.append(("switch", current))
        steps += [("wait", w.producer) for w in into.get(v, ())]
        steps.append(("issue", v))
        if v in producers:
            steps.append(("record", v))
    return steps


def _walk(
    dag: nx.DiGraph,
    order: Sequence,
    stream: Mapping[Hashable, int],
    waits: Iterable[Wait],
) -> tuple[list[tuple[Hashable, Hashable]], set[Wait]]:
    """Replay `order` with vector clocks (`replay`).

    Returns the unsatisfied dependencies (u, v) and the waits that are locally
    needed: their producer is not known finished at the consumer through the
    stream's own history and the consumer's other waits. A locally needed wait
    can never be dropped (dropping other waits only removes knowledge), so only
    the rest need a full replay to test for redundancy.
    """
    waits = list(waits)
    # a wait whose producer comes later is validate's to report; on CUDA it is a no-op
    pos = {v: i for i, v in enumerate(order)}
    live = [w for w in waits if pos.get(w.producer, math.inf) < pos.get(w.consumer, -1)]
    result = replay(dag, schedule_steps(order, stream, live))
    return list(result.unsatisfied), {w for w in live if (w.producer, w.consumer) in result.needed}


def minimal_waits(
    dag: nx.DiGraph, order: Sequence, stream: Mapping[Hashable, int]
) -> tuple[Wait, ...]:
    """Return a minimal set of waits that make `order` and `stream` respect every edge of `dag`.

    No wait in the result is redundant: dropping any one of them leaves some
    dependency unsatisfied. At each node the waits are chosen greedily, the
    predecessor whose event covers most of the still-unknown predecessors
    first; a final pass drops any wait the others already imply.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> minimal_waits(dag, ["a", "b", "c", "d"], {"a": 0, "b": 0, "c": 1, "d": 0})
    (Wait(producer='a', consumer='c'), Wait(producer='c', consumer='d'))

    Here a -> d needs no wait of its own: d is on a's stream.
    """
    pos = {v: i for i, v in enumerate(order)}
    n = max(stream.values(), default=0) + 1
    clock = [[0] * n for _ in range(n)]
    seq: dict[Hashable, int] = {}
    snap: dict[Hashable, tuple[int, ...]] = {}
    waits: list[Wait] = []
    for v in order:
        t = stream[v]
        c = clock[t]
        preds = sorted(dag.predecessors(v), key=pos.__getitem__)
        for u in preds:
            if u not in seq:
                raise ValueError(f"order is not topological: {u!r} -> {v!r} but {v!r} comes first")
        need = [u for u in preds if c[stream[u]] < seq[u]]
        while need:
            best = max(
                need,
                key=lambda u: (
                    sum(snap[u][stream[x]] >= seq[x] for x in need),
                    sum(snap[u]),
                    pos[u],
                ),
            )
            waits.append(Wait(best, v))
            for i, k in enumerate(snap[best]):
                if k > c[i]:
                    c[i] = k
            need = [u for u in need if c[stream[u]] < seq[u]]
        c[t] += 1
        seq[v] = c[t]
        snap[v] = tuple(c)

    # Safety net; in vector clocks knowing p finished means knowing all p knew,
    # so the pick covering the most at a node is never covered by a later pick
    # and every wait above is locally needed. Should one not be, one pass is a
    # fixed point: dropping waits only removes knowledge, so a wait found
    # necessary stays necessary.
    _, needed = _walk(dag, order, stream, waits)
    for w in reversed([w for w in waits if w not in needed]):
        trial = [x for x in waits if x != w]
        if not _walk(dag, order, stream, trial)[0]:
            waits = trial
    return tuple(sorted(waits, key=lambda w: (pos[w.consumer], pos[w.producer])))


def simulate(
    dag: nx.DiGraph,
    order: Sequence,
    stream: Mapping[Hashable, int],
    waits: Iterable[Wait],
    sync_cost: float = 0.0,
) -> float:
    """Return the predicted makespan: when the last stream finishes.

    Each stream runs its nodes in issue order; a node starts once its stream is
    free and every event it waits on has fired, plus `sync_cost` per wait. CPU
    issue time is ignored. Dependencies are honoured only through stream order
    and `waits`, as on the GPU, so simulate a schedule `validate` accepts.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b")])
    >>> nx.set_node_attributes(dag, {"a": 2.0, "b": 3.0}, "cost")
    >>> simulate(dag, ["a", "b"], {"a": 0, "b": 1}, [Wait("a", "b")], sync_cost=0.5)
    5.5
    """
    into: dict[Hashable, list[Hashable]] = defaultdict(list)
    for w in waits:
        into[w.consumer].append(w.producer)
    free: dict[int, float] = defaultdict(float)
    finish: dict[Hashable, float] = {}
    for v in order:
        t = stream[v]
        producers = into.get(v, ())
        for p in producers:
            if p not in finish:
                raise ValueError(f"wait {p!r} -> {v!r}: the producer is issued after the consumer")
        start = max([free[t], *(finish[p] for p in producers)]) + sync_cost * len(producers)
        finish[v] = free[t] = start + node_cost(dag, v)
    return max(finish.values(), default=0.0)


def node_shares(dag: nx.DiGraph, v: Hashable) -> Mapping[str, float]:
    """Return the fractions of each device resource `v` keeps busy alone (its `share` attribute).

    `share` is a number (one resource, "device") or a mapping such as
    ``{"compute": 0.2, "memory": 0.9}``; missing means 0 (no contention).
    """
    share = dag.nodes[v].get("share") or 0.0
    pairs = share.items() if isinstance(share, Mapping) else [("device", share)]
    return {r: min(max(float(x), 0.0), 1.0) for r, x in pairs}


def simulate_shared(dag: nx.DiGraph, schedule: Schedule) -> float:
    """Return the predicted makespan when concurrent kernels compete for one device.

    `simulate` lets every stream run at full speed, as if each kernel had the
    device to itself; on a GPU a kernel that fills the SMs leaves nothing to a
    kernel beside it. Here each node occupies a share of each device resource
    while it runs (`node_shares`; `concur.dag.cost` gives compute and memory
    bandwidth). While the running nodes' shares of some resource sum to S > 1,
    each progresses at rate 1/S (processor sharing on the busiest resource), so
    two kernels that each fill the device take as long together as one after
    the other, while a compute-bound and a memory-bound kernel can overlap.
    With every share 0 this equals `simulate` (same `sync_cost` per wait).

    >>> import networkx as nx
    >>> dag = nx.DiGraph(); dag.add_nodes_from(["a", "b"], cost=4.0, share=1.0)
    >>> s = build_schedule(dag, ["a", "b"], {"a": 0, "b": 1}, "manual")
    >>> s.makespan, simulate_shared(dag, s)
    (4.0, 8.0)
    """
    sync_cost = schedule.sync_cost
    into: dict[Hashable, list[Hashable]] = defaultdict(list)
    for w in schedule.waits:
        into[w.consumer].append(w.producer)
    queues = {k: deque(schedule.nodes_on(k)) for k in range(schedule.num_streams)}
    busy: dict[int, Hashable] = {}  # stream -> node it runs
    left: dict[Hashable, float] = {}  # node -> remaining cost at full speed
    finish: dict[Hashable, float] = {}
    free: dict[int, float] = defaultdict(float)  # stream -> when its last node finished
    now = 0.0
    while any(queues.values()) or busy:
        ready_at = {}
        for k, queue in queues.items():
            if k in busy or not queue:
                continue
            producers = into.get(queue[0], ())
            if all(p in finish for p in producers):  # as in `simulate`: from when the stream was free
                ready_at[k] = max([free[k], *(finish[p] for p in producers)]) + sync_cost * len(producers)
        for k in [k for k, t in ready_at.items() if t <= now]:
            v = queues[k].popleft()
            busy[k], left[v] = v, node_cost(dag, v)
        if not busy:
            if not ready_at:
                raise ValueError("the schedule deadlocks: a wait's producer never runs")
            now = min(ready_at.values())
            continue
        load: dict[str, float] = defaultdict(float)
        for v in busy.values():
            for resource, x in node_shares(dag, v).items():
                load[resource] += x
        slowdown = max([1.0, *load.values()])
        step = min(left[v] for v in busy.values()) * slowdown
        later = [t for t in ready_at.values() if t > now]
        step = min([step, *(t - now for t in later)])
        now += step
        for k, v in list(busy.items()):
            left[v] -= step / slowdown
            if left[v] <= 1e-9:
                finish[v] = free[k] = now
                del busy[k]
    return max(finish.values(), default=0.0)


def validate(dag: nx.DiGraph, schedule: Schedule) -> list[str]:
    """Return the problems of `schedule` for `dag`, one sentence each; empty when valid."""
    problems: list[str] = []
    order, stream, waits = schedule.order, schedule.stream, schedule.waits

    seen: set[Hashable] = set()
    for v in order:
        if v in seen:
            problems.append(f"node {v!r} is issued twice")
        elif v not in dag:
            problems.append(f"node {v!r} is in the order but not in the graph")
        seen.add(v)
    missing = [v for v in dag.nodes if v not in seen]
    if missing:
        problems.append(f"nodes missing from the order: {missing!r}")
    for v in dag.nodes:
        s = stream.get(v)
        if not isinstance(s, int) or not 0 <= s < schedule.num_streams:
            problems.append(f"node {v!r} has stream {s!r}, outside 0..{schedule.num_streams - 1}")
    if problems:
        return problems  # the checks below need every node once, on a valid stream
    used = max(stream[v] for v in order) + 1 if order else 1
    if schedule.num_streams != used:
        problems.append(f"num_streams is {schedule.num_streams}, but streams used are {schedule.streams_used}")

    pos = {v: i for i, v in enumerate(order)}
    for u, v in dag.edges:
        if pos[u] > pos[v]:
            problems.append(f"order is not topological: {u!r} -> {v!r} but {v!r} is issued first")
    if len(set(waits)) != len(waits):
        problems.append("some waits are listed twice")
    for w in waits:
        if w.producer not in pos or w.consumer not in pos:
            problems.append(f"{w} names a node that is not in the graph")
        elif stream[w.producer] == stream[w.consumer]:
            problems.append(f"{w} is within stream {stream[w.producer]}: stream order already covers it")
        elif pos[w.producer] > pos[w.consumer]:
            problems.append(f"{w}: the producer is issued after the consumer, so its event is not recorded yet")
    if problems:
        return problems

    unsatisfied, needed = _walk(dag, order, stream, waits)
    for u, v in unsatisfied:
        problems.append(
            f"dependency {u!r} -> {v!r} is not ordered: stream {stream[v]} does not wait for "
            f"{u!r} on stream {stream[u]}"
        )
    if not unsatisfied:
        for w in waits:
            if w not in needed and not _walk(dag, order, stream, [x for x in waits if x != w])[0]:
                problems.append(f"{w} is redundant: stream order and the other waits imply it")
    return problems


# --------------------------------------------------------------------------
# Building and dispatching.


def build_schedule(
    dag: nx.DiGraph,
    order: Sequence,
    stream: Mapping[Hashable, int],
    scheduler: str,
    sync_cost: float = 0.0,
) -> Schedule:
    """Return the `Schedule` for a given order and stream assignment, with minimal waits.

    Streams are renumbered by first use in `order`, so the first node runs on
    the caller's stream 0 and the streams used are exactly 0..num_streams-1.
    """
    renumber: dict[int, int] = {}
    for v in order:
        renumber.setdefault(stream[v], len(renumber))
    streams = {v: renumber[stream[v]] for v in order}
    waits = minimal_waits(dag, order, streams)
    return Schedule(
        order=tuple(order),
        stream=streams,
        waits=waits,
        num_streams=max(len(renumber), 1),
        scheduler=scheduler,
        makespan=simulate(dag, order, streams, waits, sync_cost),
        sync_cost=sync_cost,
    )


def on_caller(dag: nx.DiGraph, schedule: Schedule, nodes: Iterable[Hashable]) -> Schedule:
    """Return `schedule` with `nodes` moved to the caller's stream, in the same order, with minimal waits.

    For work that must not run on a side stream: a call that allocates on
    the stream it runs on keeps blocks there that no other stream's work can
    reuse, which a program short of memory cannot afford.

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> nx.set_node_attributes(dag, 1.0, "cost")
    >>> s = build_schedule(dag, ["a", "b", "c", "d"], {"a": 0, "b": 0, "c": 1, "d": 0}, "critical_path")
    >>> moved = on_caller(dag, s, ["c"])
    >>> dict(moved.stream), moved.num_streams, moved.waits
    ({'a': 0, 'b': 0, 'c': 0, 'd': 0}, 1, ())
    """
    caller = schedule.stream[schedule.order[0]]  # the stream build_schedule numbers 0
    nodes = set(nodes)
    stream = {v: caller if v in nodes else t for v, t in schedule.stream.items()}
    return build_schedule(dag, schedule.order, stream, schedule.scheduler, schedule.sync_cost)


SCHEDULERS: dict[str, Callable[..., Schedule]] = {}


def register(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
    """Add a scheduler to `SCHEDULERS` under its function name."""
    SCHEDULERS[fn.__name__] = fn
    return fn


def schedule(
    dag: nx.DiGraph, num_streams: int, scheduler: str = "critical_path", **kw: object
) -> Schedule:
    """Return `dag` scheduled onto at most `num_streams` streams by the named scheduler."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {sorted(SCHEDULERS)}")
    check_dag(dag, num_streams)
    return SCHEDULERS[scheduler](dag, num_streams, **kw)

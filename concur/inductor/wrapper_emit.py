"""Turn one schedule of inductor's fused kernels into a rewritten ``call``, after fusion, recompiling nothing.

Inductor compiles a graph *whole* (so fusion and layout are decided once, as
``backend="inductor"`` would), and concur then rewrites only the order and the
streams of the launches in the generated ``call`` function:

1. :mod:`concur.inductor.wrapper_parse` lists the launches with the storage groups
   each reads and writes; read/write conflicts give the dependency DAG
   (:func:`launch_dag`);
2. the DAG, costed from the fx nodes inductor names above each launch
   (:mod:`concur.inductor.aten_dag`), is scheduled, and the plan kept or
   dropped, by :mod:`concur.inductor.placement` (through
   :mod:`concur.dag.decide`, as on every other path), which hands this
   module one schedule at a time to emit;
3. host statements (allocations, aliases, shape checks) go right before the
   first launch that touches their storage, on its stream, and each ``del``
   right after the last statement naming it; with ``allocate_on_caller``, an
   allocation whose storage a side stream touches first is made on the
   caller's stream instead, at the latest point every launch touching it is
   ordered after (:func:`caller_allocations`), so that every buffer's memory
   comes from and returns to the caller's stream, as with one stream;
4. a storage used on a stream other than the one it was allocated on is
   protected with ``record_stream`` when its name dies, as in
   :mod:`concur.streams`;
5. with ``split_reuses`` (``buffer_reuse="ordered"``), inductor's reuse lines
   whose new buffer is only stored to are scheduled as fresh buffers, and
   each is kept as written only where the schedule orders every use of the
   old buffer before the new one (:func:`kept_reuses`), else allocated
   afresh; a kept reuse's storage is protected as one, from its first
   allocation's stream.

:func:`plan_emission` is pure (data in, data out) and replays its own steps
with :func:`schedulers.replay`, the checker every schedule passes;
:func:`concur.inductor.wrapper_build.build_call` turns the plan into a Python
function in the wrapper's own namespace, so the kernels, autotuned configs and
constants are the ones inductor already made.

Whatever is not read fails closed: a launch whose ``stream=`` is not a
raw-stream lookup made inside the rewritten region (where
:func:`~concur.inductor.wrapper_build.build_call` repeats it after every switch) fails
:func:`check_streams`, and the whole graph runs as inductor made it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import networkx as nx

import schedulers

from concur.dag import decide
from concur.dag.hazards import hazard_edges
from concur.inductor.kernel_signatures import _ALLOCATORS, _COPYABLE_ALLOCATORS, _dotted
from concur.inductor.wrapper_program import _ALIGNING_COPIES, KernelProgram, Reuse, Statement

# allocators outside the caching allocator (symmetric memory): no stream owns their blocks, so none is moved
_UNCACHED_ALLOCATORS = _ALLOCATORS - _COPYABLE_ALLOCATORS


@dataclass(frozen=True)
class Emit:
    """One step of the rewritten call: a statement, or a stream operation of :class:`concur.streams.StreamRuntime`."""

    op: str                        # "stmt", "switch", "wait", "record", "protect"
    statement: Statement | None = None
    index: int = 0                 # stream for switch, event for wait/record
    name: str = ""                 # protect: the tensor's name
    streams: tuple[int, ...] = ()  # protect: the streams to record


@dataclass(frozen=True)
class KernelStreamPlan:
    """The rescheduled launches of one inductor graph."""

    steps: tuple[Emit, ...]
    protect_at_end: tuple[tuple[str, tuple[int, ...]], ...]
    num_streams: int
    num_events: int
    num_waits: int
    num_launches: int
    num_barriers: int
    ideal_speedup: float
    predicted_speedup: float
    reuses_kept: int = 0    # inductor's reuse lines emitted as it wrote them (the new buffer in the old memory)
    reuses_fresh: int = 0   # reuse lines emitted as a fresh allocation, their buffers not ordered otherwise
    allocations_on_caller: int = 0  # side-stream buffers allocated on the caller's stream (caller_allocations)


def launch_dag(program: KernelProgram, node_costs: Mapping[str, tuple[float, dict]],
               default_cost: float) -> nx.DiGraph:
    """Return the DAG of the program's launches (nodes: statement index) with ``cost`` and ``share``.

    A launch costs what the fx nodes listed above it cost once fused (each
    node counted once); a launch naming none costs ``default_cost`` (a launch).
    """
    dag = nx.DiGraph()
    claimed: set[str] = set()
    for s in program.launches:
        mine = [o for o in s.origins if o in node_costs and o not in claimed]
        claimed.update(mine)
        cost = sum(node_costs[o][0] for o in mine) or default_cost
        share = max((node_costs[o] for o in mine), key=lambda c: c[0], default=(0.0, {}))[1]
        dag.add_node(s.index, cost=cost, share=share, view=False, heavy=True, barrier=s.kind == "barrier")
    for u, v in hazard_edges((s.index, s.reads, s.writes) for s in program.launches):
        dag.add_edge(u, v)
    return dag


def kept_reuses(program: KernelProgram, schedule: schedulers.Schedule) -> frozenset[int]:
    """Return the split reuses (their alias statements' indices) that ``schedule`` orders anyway.

    A reuse of :attr:`KernelProgram.reuses` is kept, its new buffer put in
    the old one's memory as inductor wrote it, when every launch touching
    the old buffer happens before the first launch touching the new one:
    earlier on the same stream, or through the schedule's events, as
    :func:`schedulers.replay`'s vector clocks see it. Every other reuse gets
    a fresh allocation (:attr:`~concur.inductor.wrapper_program.Reuse.fresh`).
    A reuse whose old buffer no launch touched is never kept: its alias
    could not be placed after the old name is bound.
    """
    if not program.reuses:
        return frozenset()
    edges = _reuse_edges(program, program.reuses)
    dag = nx.DiGraph()
    dag.add_nodes_from(schedule.order)
    dag.add_edges_from(e for r in program.reuses for e in edges[r.statement])
    steps = schedulers.schedule_steps(schedule.order, schedule.stream, schedule.waits)
    unordered = set(schedulers.replay(dag, steps).unsatisfied)
    return frozenset(r.statement for r in program.reuses
                     if edges[r.statement] and not unordered.intersection(edges[r.statement]))


def written_inputs(program: KernelProgram) -> frozenset[int]:
    """Return the positions (in ``args``) of the inputs whose memory inductor's own call may write.

    A launch's writes are followed back through inductor's reuse lines, split
    or not, to the storage they live in: ``buf23 = relu_5; del relu_5  #
    reuse`` puts ``buf23`` in the memory of the input ``relu_5`` (a
    backward's donated buffer). A barrier writes whatever it names. An
    aligning copy (``x = copy_if_misaligned(x)``) is read as writing its
    argument only to order it; its own write is not counted.
    """
    storage = _storages(program, frozenset(r.statement for r in program.reuses))
    written = {storage.get(g, g) for s in program.launches if not _aligning_copy(s) for g in s.writes}
    return frozenset(i for i, name in enumerate(program.inputs) if name in written)


def _aligning_copy(s: Statement) -> bool:
    call = s.node.value if isinstance(s.node, ast.Assign) else None
    return isinstance(call, ast.Call) and ast.unparse(call.func).split(".")[-1] in _ALIGNING_COPIES


def _reuse_edges(program: KernelProgram, reuses: Iterable[Reuse]) -> dict[int, list[tuple[int, int]]]:
    """Return, per reuse, the orders that keeping it needs: each launch touching the old group -> the first new one."""
    touching: dict[str, list[int]] = {}
    for s in program.launches:
        for g in s.groups | s.reads | s.writes:
            touching.setdefault(g, []).append(s.index)
    return {r.statement: [(u, r.first_access) for u in touching.get(r.old_group, ())] for r in reuses}


def _storages(program: KernelProgram, kept: frozenset[int]) -> dict[str, str]:
    """Return {group: the group whose allocation it lives in} for the groups a kept reuse puts in older memory."""
    storage: dict[str, str] = {}
    for r in sorted(program.reuses, key=lambda r: r.statement):  # a chain of reuses: new ones follow old ones
        if r.statement in kept:
            storage[r.new_group] = storage.get(r.old_group, r.old_group)
    return storage


def plan_emission(program: KernelProgram, schedule: schedulers.Schedule, dag: nx.DiGraph, *,
                  allocate_on_caller: bool = False) -> KernelStreamPlan:
    """Return the rewritten call as steps: launches in schedule order, host statements placed around them.

    A split reuse (:attr:`KernelProgram.reuses`) is kept where
    :func:`kept_reuses` says the schedule orders it, else its alias becomes
    a fresh allocation; either way the storage it ends up in is protected as
    one: its home is the stream its allocation was placed on, and every
    stream that touched any group living in it is recorded when a name of
    it dies.

    With ``allocate_on_caller``, the allocations :func:`caller_allocations`
    picks are made on the caller's stream, and counted in
    :attr:`KernelStreamPlan.allocations_on_caller`.

    Four phases: host statements are anchored to launches
    (:func:`_sequence`), each ``del`` goes after the last statement naming
    it (:func:`_dels_after`), stream switches, waits, records and
    ``record_stream`` protections are emitted (:class:`_Emitter`), and the
    result is replayed against the DAG (:func:`_check_plan`).

    Raises:
        ValueError: the result would use a name before binding it or after deleting it, break a
            dependency or keep a reuse its steps do not order (a concur bug).
    """
    kept = kept_reuses(program, schedule)
    fresh = {r.statement: r.fresh for r in program.reuses if r.statement not in kept}
    statements = sorted((fresh.get(s.index, s) if s.kind == "host" else s for s in program.statements),
                        key=lambda s: s.index)
    storage = _storages(program, kept)
    on_caller = caller_allocations(schedule, statements, storage) if allocate_on_caller else {}
    sequence = _sequence(program, schedule, statements, on_caller)
    dels = [s for s in statements if s.kind == "del"]
    emitter = _Emitter(schedule, storage)
    steps = emitter.emit(sequence, _dels_after(sequence, dels))
    at_end = emitter.protect_at_end(program, sequence, dels)
    _check_plan(program, kept, dag, steps)
    prediction = decide.predict(dag, schedule)
    return KernelStreamPlan(tuple(steps), tuple(at_end), schedule.num_streams, len(emitter.events),
                            len(schedule.waits), len(program.launches),
                            sum(1 for s in program.launches if s.kind == "barrier"), prediction.ideal_speedup,
                            prediction.speedup, program.reuse_lines - len(fresh), len(fresh), len(on_caller))


def caller_allocations(schedule: schedulers.Schedule, statements: list[Statement],
                       storage: Mapping[str, str]) -> dict[int, int]:
    """Return the allocations to make on the caller's stream: {statement index: where, as an issue position}.

    An allocation qualifies when the first launch touching its storage, in
    ``schedule``'s issue order, is on a side stream, it uses no name the
    region binds, and its allocator is the caching allocator. It goes right
    after the caller's-stream launch at the position given (-1: at the
    start, right after the fork), on the caller's stream: the latest launch
    there that every side-stream launch touching the storage is ordered
    after (:func:`caller_progress`).

    Why: the caching allocator gives a freed block back only to the stream
    that allocated it. Made on a side stream, a buffer's memory serves only
    that stream once freed, and the blocks the caller's stream frees (a
    forward's saved activations, freed one by one in backward) serve none of
    the side streams' allocations: each stream's pool grows to its own peak.
    Made on the caller's stream, every buffer comes from, and goes back to,
    one pool, as with one stream. It is safe there: a block the caller's
    stream hands out at that point was last used on it by work issued
    before, which every launch touching the new buffer waits for; its
    earlier users on other streams were recorded on it when it was freed
    (``record_stream``), so the allocator holds it until the graph orders
    them first. Storage first touched on the caller's stream stays where
    it is, and so does symmetric memory, which no stream owns.
    """
    bound = {name for s in statements for name in s.binds}
    launches = {s.index: s for s in statements if s.is_launch}
    position = {v: i for i, v in enumerate(schedule.order)}
    touching: dict[str, list[int]] = {}
    for v in schedule.order:
        s = launches[v]
        for g in s.groups | s.reads | s.writes:
            touching.setdefault(storage.get(g, g), []).append(v)
    progress = caller_progress(schedule)
    placed: dict[int, int] = {}
    for s in statements:
        if s.kind != "host" or not s.fresh or s.uses & bound or _calls(s, _UNCACHED_ALLOCATORS):
            continue
        users = [v for g in s.fresh for v in touching.get(storage.get(g, g), ())]
        if not users or schedule.stream[min(users, key=position.__getitem__)] == 0:
            continue
        placed[s.index] = min(progress[v] for v in users if schedule.stream[v] != 0)
    return placed


def caller_progress(schedule: schedulers.Schedule) -> dict[Any, int]:
    """Return {launch: the issue position of the last caller's-stream launch it is ordered after (-1: none)}.

    Ordered after means: later on the same stream, or through the
    schedule's events, transitively. A caller's-stream launch is ordered
    after itself. -1 is the fork at the start, which every side stream
    waits for.
    """
    position = {v: i for i, v in enumerate(schedule.order)}
    waits: dict[Any, list[Any]] = {}
    for w in schedule.waits:
        waits.setdefault(w.consumer, []).append(w.producer)
    progress: dict[Any, int] = {}
    last_on: dict[int, Any] = {}
    for v in schedule.order:
        stream = schedule.stream[v]
        if stream == 0:
            progress[v] = position[v]
        else:
            before = [last_on[stream]] if stream in last_on else []
            progress[v] = max((progress[u] for u in before + waits.get(v, [])), default=-1)
        last_on[stream] = v
    return progress


def _calls(s: Statement, functions: frozenset[str] | set[str]) -> bool:
    """Whether the statement calls one of ``functions`` (by the last part of its dotted name)."""
    return any(isinstance(n, ast.Call) and (_dotted(n.func) or "").split(".")[-1] in functions
               for n in ast.walk(s.node))


def _sequence(program: KernelProgram, schedule: schedulers.Schedule, statements: list[Statement],
              on_caller: Mapping[int, int] | None = None) -> list[tuple[Statement, int]]:
    """Return every statement but the ``del``s in issue order, with the stream it runs on.

    A host statement goes right before the first launch (in issue order)
    that touches its storage and comes after whatever binds the names it
    uses; one that touches no storage and uses no launch's result goes at
    the start, one no later launch touches at the end, both on the caller's
    stream. The host statements in ``on_caller`` (:func:`caller_allocations`)
    go on the caller's stream right after the launch at the issue position
    given (-1: at the start).
    """
    on_caller = on_caller or {}
    in_order = program.launches  # a property that filters every statement: read once, not per host statement
    launches = {s.index: s for s in in_order}
    position = {v: i for i, v in enumerate(schedule.order)}
    end = len(schedule.order)
    anchor: dict[int, int] = {}  # host statement -> position of the launch it goes before (-1: start, end: after all)
    after: dict[int, list[Statement]] = {}  # position -> allocations right after its launch, on the caller's stream
    binder_position: dict[str, int] = {}  # name -> issue position after which it is bound
    for s in statements:
        if s.is_launch:
            for name in s.binds:
                binder_position[name] = position[s.index] + 1
            continue
        if s.kind != "host":
            continue
        if on_caller.get(s.index, -1) >= 0:
            after.setdefault(on_caller[s.index], []).append(s)
            for name in s.binds:
                binder_position[name] = on_caller[s.index] + 1
            continue
        if s.index in on_caller or (not s.groups and not (s.uses & set(binder_position))):
            anchor[s.index] = -1
            for name in s.binds:
                binder_position[name] = 0
            continue
        ready = max((binder_position.get(n, 0) for n in s.uses), default=0)
        later = [position[k.index] for k in in_order
                 if k.index > s.index and k.groups & s.groups and position[k.index] >= ready]
        anchor[s.index] = min(later, default=end)
        for name in s.binds:
            binder_position[name] = max(anchor[s.index], 0)

    hosts_at: dict[int, list[Statement]] = {}
    for s in statements:
        if s.index in anchor:
            hosts_at.setdefault(anchor[s.index], []).append(s)
    sequence: list[tuple[Statement, int]] = [(s, 0) for s in hosts_at.get(-1, [])]
    for v in schedule.order:
        stream = schedule.stream[v]
        sequence += [(s, stream) for s in hosts_at.get(position[v], [])]
        sequence.append((launches[v], stream))
        sequence += [(s, 0) for s in after.get(position[v], [])]
    sequence += [(s, 0) for s in hosts_at.get(end, [])]
    return sequence


def _dels_after(sequence: list[tuple[Statement, int]], dels: list[Statement]) -> dict[int, list[Statement]]:
    """Return {position in ``sequence``: the ``del`` statements right after it} (-1: before everything)."""
    last_use: dict[str, int] = {}
    for i, (s, _) in enumerate(sequence):
        for name in s.uses | s.binds:
            last_use[name] = i
    dels_after: dict[int, list[Statement]] = {}
    for d in dels:
        (name,) = tuple(d.uses)
        dels_after.setdefault(last_use.get(name, -1), []).append(d)
    return dels_after


class _Emitter:
    """Turns the placed statements into :class:`Emit` steps, tracking which streams touched each storage.

    A storage's home is the stream its allocation was placed on (inputs:
    the caller's, 0); when a name of it dies, every other stream that
    touched it is recorded on it (``protect``), so the caching allocator
    does not hand its memory to the home stream while another still uses it.
    """

    def __init__(self, schedule: schedulers.Schedule, storage: Mapping[str, str]):
        self.storage = storage
        self.events: dict[Any, int] = {}
        for w in schedule.waits:
            self.events.setdefault(w.producer, len(self.events))
        self.waits_of: dict[Any, list[int]] = {}
        for w in schedule.waits:
            self.waits_of.setdefault(w.consumer, []).append(self.events[w.producer])
        self.home: dict[str, int] = {}
        self.touched: dict[str, set[int]] = {}
        self.steps: list[Emit] = []

    def root(self, group: str) -> str:
        return self.storage.get(group, group)

    def others(self, groups: Iterable[str]) -> tuple[int, ...]:
        """Return the streams other than their storage's home that touched ``groups``."""
        return tuple(sorted({t for g in groups for t in self.touched.get(self.root(g), ())
                             if t != self.home.get(self.root(g), 0)}))

    def release(self, d: Statement) -> None:
        (name,) = tuple(d.uses)
        streams = self.others(d.groups)
        if streams:
            self.steps.append(Emit("protect", name=name, streams=streams))
        self.steps.append(Emit("stmt", d))

    def emit(self, sequence: list[tuple[Statement, int]], dels_after: Mapping[int, list[Statement]]) -> list[Emit]:
        """Return the steps of ``sequence``, switching streams as it goes, each ``del`` where ``dels_after`` puts it."""
        current = 0
        for d in dels_after.get(-1, []):
            self.release(d)
        for i, (s, stream) in enumerate(sequence):
            if stream != current:
                self.steps.append(Emit("switch", index=stream))
                current = stream
            if s.is_launch:
                self.steps += [Emit("wait", index=e) for e in self.waits_of.get(s.index, [])]
            self.steps.append(Emit("stmt", s))
            for g in s.fresh:
                self.home[self.root(g)] = stream
            if s.is_launch:
                for g in s.groups | s.reads | s.writes:
                    self.touched.setdefault(self.root(g), set()).add(stream)
                if s.index in self.events:
                    self.steps.append(Emit("record", index=self.events[s.index]))
            for d in dels_after.get(i, []):
                self.release(d)
        return self.steps

    def protect_at_end(self, program: KernelProgram, sequence: list[tuple[Statement, int]],
                       dels: list[Statement]) -> list[tuple[str, tuple[int, ...]]]:
        """Return the names alive at the end (outputs, inputs) that other streams than their home touched."""
        deleted = {n for d in dels for n in d.uses}
        group_of = {name: name for name in program.inputs}
        for s, _ in sequence:
            for name in s.binds:
                group_of[name] = s.bind_group
        at_end = []
        for name in sorted(set(group_of) - deleted):
            g = group_of[name]
            streams = self.others({g}) if g else ()
            if streams:
                at_end.append((name, streams))
        return at_end


def _check_plan(program: KernelProgram, kept: frozenset[int], dag: nx.DiGraph, steps: list[Emit]) -> None:
    """Check the steps bind every name before use, keep every dependency and order every kept reuse.

    Raises:
        ValueError: any of them fails (a concur bug).
    """
    _check_names(program, steps)
    issued = _issue_steps(steps)
    problems = schedulers.replay(dag, issued).problems
    if problems:
        raise ValueError(f"the rewritten call breaks a dependency (a concur bug, please report it): {problems[:3]}")
    _check_kept_reuses(program, kept, dag, issued)


def _check_kept_reuses(program: KernelProgram, kept: frozenset[int], dag: nx.DiGraph,
                       issued: list[tuple[str, Any]]) -> None:
    """Replay the plan's steps once more: every kept reuse must be ordered after all uses of the old buffer.

    Raises:
        ValueError: a kept reuse whose new buffer's first launch may overlap a launch of the old one.
    """
    if not kept:
        return
    edges = _reuse_edges(program, [r for r in program.reuses if r.statement in kept])
    order = nx.DiGraph()
    order.add_nodes_from(dag)
    order.add_edges_from(e for pairs in edges.values() for e in pairs)
    problems = schedulers.replay(order, issued).problems
    if problems:
        raise ValueError(f"the rewritten call keeps a buffer reuse its streams do not order (a concur bug, please "
                         f"report it): {problems[:3]}")


def _issue_steps(steps: list[Emit] | tuple[Emit, ...]) -> list[tuple[str, Any]]:
    """Return the plan's stream operations and launches as :func:`schedulers.replay` steps."""
    out: list[tuple[str, Any]] = []
    for step in steps:
        if step.op in ("switch", "wait", "record"):
            out.append((step.op, step.index))
        elif step.op == "stmt" and step.statement.is_launch:
            out.append(("issue", step.statement.index))
    return out


def check_streams(program: KernelProgram) -> None:
    """Check that every ``stream=`` of the region names a raw-stream lookup made inside it.

    :func:`~concur.inductor.wrapper_build.build_call` repeats those lookups after each stream switch, which
    is what moves a launch to its stream. A ``stream=`` bound anywhere else (a
    lookup hoisted above the region, an argument, any other expression) would
    keep its launch on the caller's stream while the events that order it go
    to the side streams.

    Raises:
        ValueError: a ``stream=`` this module does not rebind, or a lookup it cannot repeat.
    """
    lookups = [s for s in program.statements if s.kind == "stream"]
    ours = {name for s in lookups for name in s.binds}
    rebound = {name for s in program.statements if s.kind != "stream" for name in s.binds} & ours
    for s in lookups:
        call = s.node.value if isinstance(s.node, ast.Assign) else None
        if not isinstance(call, ast.Call) or call.keywords or not all(isinstance(a, ast.Constant) for a in call.args):
            raise ValueError(f"the raw-stream lookup `{ast.unparse(s.node)}` (wrapper line {s.node.lineno}) takes "
                             "arguments that cannot be repeated after a stream switch")
    for s in program.statements:
        for node in ast.walk(s.node):
            if not isinstance(node, ast.keyword) or node.arg != "stream":
                continue
            value = node.value
            if not isinstance(value, ast.Name):
                why = "is not the name of a raw-stream lookup"
            elif value.id not in ours:
                why = "is not bound by a raw-stream lookup inside the rewritten region"
            elif value.id in rebound:
                why = "is rebound by another statement of the region"
            else:
                continue
            raise ValueError(f"`{ast.unparse(s.node)[:120]}` (wrapper line {s.node.lineno}) passes "
                             f"stream={ast.unparse(value)}, which {why}: its launch would stay on the "
                             "caller's stream")


def _check_names(program: KernelProgram, steps: list[Emit]) -> None:
    local = set(program.inputs)
    for s in program.statements:
        local |= s.binds
    # names bound before the region (inputs, a prologue's) are bound from the start, and so are the
    # raw-stream lookups, which build_call repeats at the start and after every stream switch
    bound = local - {n for s in program.statements if s.kind != "stream" for n in s.binds}
    for step in steps:
        s = step.statement
        if step.op == "protect":
            if step.name not in bound:
                raise ValueError(f"record_stream on {step.name} after it was deleted")
            continue
        if s is None:
            continue
        missing = (s.uses & local) - bound
        if missing:
            raise ValueError(f"statement {s.index} would use {sorted(missing)} unbound")
        if s.kind == "del":
            bound -= s.uses
        else:
            bound |= s.binds

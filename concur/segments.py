"""Cut a scheduled aten graph into per-stream segments, and run compiled segments on their streams.

A *segment* is a run of consecutive ops on one stream that needs no event in
its middle: it starts where a cross-stream wait is due and ends right after
an op another stream waits for. On a 2-stream Inception block::

    stream 0:  [stem ─ branch1 ─ │ concat ─ ...]      two segments: the concat
    stream 1:       [branch2] ───┘                    waits for branch2's event

Each segment becomes a GraphModule that a compiler (inductor, or nothing for
the eager path) turns into fused kernels; fusion happens *inside* segments,
concurrency *between* them. Segments are issued in the order their first op
appears in the schedule; that order is topological, because a waiting op
always starts a segment and an event's producer ends one.

Every segment costs an inductor compilation, so ``max_event_delay`` (same
unit as ``node_cost``, off by default) lets a segment run on past an op that
another stream waits for, for at most that much work: the event is recorded
later, which can only add ordering (the consumer waits longer), never remove
it, and the ops carried along need no wait of their own, so the issue order
stays topological. :func:`verify` checks the result either way.

The plan (:class:`SegmentPlan`) is pure data over fx nodes; the runner
(:class:`SegmentedCall`) is the only part that touches streams, through the
same :class:`concur.runtime.StreamRuntime` as the unfused path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from schedulers import Schedule

from .aten_dag import is_unpack, root
from .runtime import StreamRuntime


@dataclass(frozen=True)
class Segment:
    """Ops issued back to back on one stream, with the values they exchange with other segments."""

    index: int
    stream: int
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]      # values read here, made elsewhere (graph inputs included)
    outputs: tuple[str, ...]     # values made here, read by later segments or returned
    waits: tuple[int, ...]       # events waited for before the first op
    event: int | None            # event recorded after the last op, if any stream waits for it
    foreign: tuple[str, ...]     # inputs allocated on another stream (record_stream needed)
    release: tuple[str, ...]     # values whose last reader is this segment


@dataclass(frozen=True)
class SegmentPlan:
    """A graph cut into segments, plus where its inputs and outputs live."""

    segments: tuple[Segment, ...]
    placeholders: tuple[str, ...]
    constants: tuple[str, ...]           # get_attr nodes, read from the GraphModule
    outputs: tuple[Any, ...]             # per graph output: a value name or a non-tensor constant
    num_streams: int
    num_events: int


def _issue_groups(graph: fx.Graph, schedule: Schedule) -> list[tuple[str, int, list[str]]]:
    """Return (op, stream, the op's unpacks) in issue order: unpacks go right after their producer."""
    unpacks: dict[str, list[str]] = {}
    for n in graph.nodes:
        if is_unpack(n):
            unpacks.setdefault(root(n).name, []).append(n.name)
    return [(name, schedule.stream[name], unpacks.get(name, [])) for name in schedule.order]


def partition(graph: fx.Graph, schedule: Schedule, node_cost: Callable[[str], float] | None = None,
              max_event_delay: float = 0.0) -> SegmentPlan:
    """Return ``graph`` cut into segments following ``schedule`` (see the module docstring).

    With ``max_event_delay > 0`` (and ``node_cost``), a segment holding an op
    that another stream waits for goes on while the ops after that op cost at
    most ``max_event_delay`` in all: fewer segments, later events.
    """
    if max_event_delay > 0 and node_cost is None:
        raise ValueError("max_event_delay needs node_cost")
    by_name = {n.name: n for n in graph.nodes}
    consumers = {w.consumer for w in schedule.waits}
    producers = {w.producer for w in schedule.waits}
    members: list[list[str]] = []
    streams: list[int] = []
    open_segment: dict[int, int] = {}
    delayed: dict[int, float] = {}  # per stream: work issued after the open segment's first producer
    segment_of: dict[str, int] = {}
    for name, s, unpacks in _issue_groups(graph, schedule):
        cost = node_cost(name) if max_event_delay > 0 else 0.0
        if s in delayed and delayed[s] + cost > max_event_delay:
            del open_segment[s], delayed[s]  # the event may wait no longer
        if s not in open_segment or name in consumers:
            open_segment[s] = len(members)
            delayed.pop(s, None)
            members.append([])
            streams.append(s)
        index = open_segment[s]
        for member in (name, *unpacks):
            members[index].append(member)
            segment_of[member] = index
        if s in delayed:
            delayed[s] += cost
        if name in producers:  # the event follows the op and its unpacks
            if max_event_delay > 0:
                delayed.setdefault(s, 0.0)
            else:
                del open_segment[s]

    event_of_segment: dict[int, int] = {}
    for w in schedule.waits:
        event_of_segment.setdefault(segment_of[w.producer], len(event_of_segment))
    placeholders = tuple(n.name for n in graph.nodes if n.op == "placeholder")
    constants = tuple(n.name for n in graph.nodes if n.op == "get_attr")
    # where each value was allocated: graph inputs on the caller's stream, constants never freed
    home: dict[str, int | None] = {**{p: 0 for p in placeholders}, **{c: None for c in constants}}
    output_node = next(n for n in graph.nodes if n.op == "output")

    reads: list[list[str]] = []
    last_reader: dict[str, int] = {}
    for i, names in enumerate(members):
        inside = set(names)
        ins: list[str] = []
        for name in names:
            for u in by_name[name].all_input_nodes:
                if u.name not in inside and u.name not in ins:
                    ins.append(u.name)
        reads.append(ins)
        for u in ins:
            last_reader[u] = i
    returned = {u.name for u in output_node.all_input_nodes}
    needed_later = set(last_reader) | returned

    segments = []
    for i, names in enumerate(members):
        waits = tuple(sorted({event_of_segment[segment_of[w.producer]] for w in schedule.waits
                              if segment_of[w.consumer] == i}))
        outputs = tuple(n for n in names if n in needed_later)
        allocated = {u: home[u] if u in home else streams[segment_of[u]] for u in reads[i]}
        foreign = tuple(u for u in reads[i] if allocated[u] not in (streams[i], None))
        release = tuple(u for u in reads[i] if last_reader[u] == i and u not in returned
                        and u not in constants)
        segments.append(Segment(i, streams[i], tuple(names), tuple(reads[i]), outputs, waits,
                                event_of_segment.get(i), foreign, release))

    outputs = tuple(a.name if isinstance(a, fx.Node) else a for a in _flat_outputs(output_node))
    return SegmentPlan(tuple(segments), placeholders, constants, outputs,
                       schedule.num_streams, len(event_of_segment))


def _flat_outputs(output_node: fx.Node) -> list[Any]:
    args = output_node.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def segment_module(gm: fx.GraphModule, segment: Segment) -> fx.GraphModule:
    """Return a GraphModule computing ``segment``: its inputs as placeholders, its outputs as a tuple.

    Every output is marked user-visible with the strides recorded during
    tracing, so a compiler keeps the layout the next segment was compiled for.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in segment.inputs:
        original = by_name[name]
        p = graph.placeholder(name)
        p.meta = dict(original.meta)
        env[original] = p
    for name in segment.nodes:
        env[by_name[name]] = graph.node_copy(by_name[name], lambda u: env[u])
    out = graph.output(tuple(env[by_name[n]] for n in segment.outputs))
    vals = [by_name[n].meta.get("val") for n in segment.outputs]
    out.meta["user_visible_output_idxs"] = list(range(len(vals)))
    out.meta["original_output_strides"] = [v.stride() if isinstance(v, torch.Tensor) else None
                                           for v in vals]
    return fx.GraphModule(gm, graph, f"ConcurSegment{segment.index}")


SegmentFn = Callable[[list], Sequence[Any]]


class SegmentedCall:
    """Run compiled segments on their streams; a boxed callable as AOTAutograd expects.

    Values live in a dict only until their last reader has been issued, so
    peak memory follows the serial program's; a value read on another stream
    than the one that allocated it is protected with ``record_stream``.
    """

    def __init__(self, gm: fx.GraphModule, plan: SegmentPlan, compiled: Sequence[SegmentFn]):
        # an instance attribute: wrappers that copy ``__dict__`` (functools.wraps) must see it
        self._boxed_call = True
        self.plan = plan
        self.compiled = list(compiled)
        self.constant_values = {c: _get_attr(gm, gm.graph, c) for c in plan.constants}
        self.runtime = StreamRuntime(plan.num_streams, plan.num_events)

    def __call__(self, args: list) -> list:
        plan, rt = self.plan, self.runtime
        values: dict[str, Any] = dict(zip(plan.placeholders, args))
        values.update(self.constant_values)
        args.clear()  # boxed convention: the inputs are ours to drop once no segment needs them
        rt.fork(*[values[p] for p in plan.placeholders])
        try:
            for seg, fn in zip(plan.segments, self.compiled):
                rt.switch(seg.stream)
                for e in seg.waits:
                    rt.wait(e)
                if seg.foreign:
                    rt.keep(*[values[u] for u in seg.foreign])
                results = fn([values[u] for u in seg.inputs])
                values.update(zip(seg.outputs, results))
                if seg.event is not None:
                    rt.record(seg.event)
                for u in seg.release:
                    del values[u]
            outputs = [values[o] if isinstance(o, str) and o in values else o for o in plan.outputs]
            rt.join(*outputs)
        except BaseException:
            rt.abort()
            raise
        return outputs


def _get_attr(gm: fx.GraphModule, graph: fx.Graph, name: str) -> Any:
    node = next(n for n in graph.nodes if n.name == name)
    value: Any = gm
    for atom in str(node.target).split("."):
        value = getattr(value, atom)
    return value


def verify(plan: SegmentPlan) -> list[str]:
    """Return the problems of ``plan``, one sentence each: an input read before it is made or synced.

    Vector clocks, as in :mod:`concur.verify`: a stream's clock says how far
    it has seen each other stream's work; an event carries the clock of the
    stream that recorded it; a value made on stream t may be read on stream s
    only once s's clock covers the segment that made it.
    """
    problems: list[str] = []
    n = plan.num_streams
    clock = [[0] * n for _ in range(n)]
    event_clock: dict[int, list[int]] = {}
    made_at: dict[str, tuple[int, int]] = {}  # value -> (stream, position on that stream)
    for p in plan.placeholders:
        made_at[p] = (0, 0)  # the fork makes every stream wait for the caller's queued work
    for seg in plan.segments:
        s = seg.stream
        for e in seg.waits:
            if e not in event_clock:
                problems.append(f"segment {seg.index} waits for event {e} before it is recorded")
                continue
            clock[s] = [max(a, b) for a, b in zip(clock[s], event_clock[e])]
        for u in seg.inputs:
            if u in plan.constants:
                continue
            if u not in made_at:
                problems.append(f"segment {seg.index} reads {u} before any segment makes it")
                continue
            t, position = made_at[u]
            if t != s and clock[s][t] < position:
                problems.append(f"segment {seg.index} on stream {s} reads {u} from stream {t} without a wait")
        clock[s][s] += 1
        for u in seg.outputs:
            made_at[u] = (s, clock[s][s])
        if seg.event is not None:
            event_clock[seg.event] = list(clock[s])
    return problems

"""Stamp concur's schedule onto the post-grad aten graph and let inductor emit the streams (torch >= 2.13).

From torch 2.13 on, inductor has stream machinery of its own, fed by
``node.meta["custom"]["stream"]`` on the fx graph it lowers:

* ``GraphLowering.run_node`` lowers each node inside its stream and realizes
  inputs that come from another stream, so no pointwise op is inlined across
  (a realization is stamped with the stream current at that moment: the
  consumer's, unless something on the producer's stream realized it first,
  which the event recorded right after it does here);
* ``Scheduler._populate_stream_assignments`` gives every scheduler node the
  stream of its IR node *before* fusion, and fusion, in-place reuse and the
  wrapper's buffer pool are all keyed by stream (nothing is fused or reused
  across streams);
* the Python wrapper opens ``with streamN:`` around each run of launches of
  one stream and, inside the device guard, fetches ``streamN =
  _get_stream_by_index(i)`` (2.13: ``get_external_object_by_index(i)``) from
  dynamo's table of user objects, where ``i`` is the value of the stamp (an
  index into that table, not a stream number). CPU has no device guard: its
  wrapper enters ``with default_stream:`` / ``with streamN:`` and never
  defines them, so stamped CPU code raises NameError unless the names are
  bound (:func:`compile_stamped` binds no-op contexts when asked to stamp CPU).

Inductor does *not* add events: ordering across streams comes only from
``torch.ops.streams.record_event`` / ``wait_event`` nodes in the graph, each
wrapped in the ``control_deps`` higher-order op so that inductor's scheduler
cannot move a consumer above its wait (dynamo puts them there for user
streams; AOTAutograd adds them for the backward of annotated forwards). A
post-grad pass sees the forward and backward graphs after partitioning, so
concur schedules each itself, as the wrapper route does, and inserts:

1. a *fork*: the caller's stream records an event that each side stream
   waits on before it reads a graph input;
2. per value read on another stream: one event recorded right after it on
   its stream and one wait per reading stream, the value passed *through*
   the wait (a ``control_deps`` pass-through), so every reader on that stream
   reads it after the wait, whatever order inductor gives them. Hence one
   wait per (value, reading stream), not the schedule's minimal waits: those
   lean on the order within a stream, which inductor may change;
3. per mutation or random-op ordering edge across streams: the same, with one
   of the later op's own inputs passed through;
4. a *join*: each side stream records after its last ops and the caller's
   stream waits on it, so the outputs are ready when the call returns;
5. ``torch.ops.streams.record_stream`` for each tensor read on a stream
   other than the one that allocated it (and each graph input read on a side
   stream), so the caching allocator does not hand its memory to the
   allocating stream while another still reads it. Forward and backward
   graphs use separate side streams, so a saved activation freed during the
   backward returns to a forward stream, whose next use waits on the caller.

Stream and event objects live in dynamo's table of user objects
(``torch._dynamo.graph_bytecode_inputs``) at fixed indices far above those
dynamo hands out (0, 1, 2, ... per frame), so the generated code and
inductor's FX graph cache key depend only on the graph and the options.
Dynamo clears that table (2.15: replaces it) when a frame with user
objects runs, so :class:`StreamTableCall` checks it before each call of a
compiled graph and puts concur's objects back when they are missing (2.15:
puts them in for the call and takes them out after it, see
:class:`concur._torch_compat.ExternalObjects`); it also points the
caller-stream index at the current stream.

The fx graph is also put in the schedule's issue order, and inductor's
reordering for peak memory is off while it compiles (``keep_order``): with it
on, inductor issued a stream-0 consumer before the third branch's matmul.

Not yet measured on a GPU. torch 2.11 lacks this machinery (only
``make_fallback`` of the two event ops); 2.13.0, 2.14.1 and 2.15.0 have it. What is tested, on CPU with each: the stamps, the syncs against a
happens-before oracle, the stream contexts and event order of inductor's CPU
wrapper and of its CUDA wrapper generated without a GPU (device properties
faked, extern kernels only), the FX graph cache, and training values
(stamped, without events: CPU cannot run them). Not tested anywhere: a run
on a GPU, :class:`StreamTableCall` inside the compiled pipeline, CUDA graphs
(``mode="reduce-overhead"``) and the allocator argument of point 5.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

import schedulers

from concur import _torch_compat as compat
from concur.dag import decide
from concur.dag.cost import Roofline
from concur.inductor.aten_dag import build_aten_dag, is_unpack, is_view, root

# Indices in dynamo's user-object table: far above dynamo's own (0, 1, ... per frame), and few enough for
# torch 2.15's table, a list that compat pads up to them (about 4k entries more per device).
TABLE_BASE = 1 << 12
_DEVICE_STRIDE = 1 << 12   # per device index: 2 * _KIND_STRIDE streams, then MAX_EVENTS events
_KIND_STRIDE = 128         # forward / backward side streams
MAX_STREAMS = _KIND_STRIDE
EVENT_OFFSET = 2 * _KIND_STRIDE
MAX_EVENTS = 2048          # created once per device; a graph needing more stays on one stream
CALLER = 0                 # slot of the caller's stream (the current stream when the graph is called)


def stream_slot(device_index: int, backward: bool, stream: int) -> int:
    """Return the table index of concur's side ``stream`` (>= 1), or of the caller's stream (0)."""
    if stream == CALLER:
        return TABLE_BASE + device_index * _DEVICE_STRIDE
    return TABLE_BASE + device_index * _DEVICE_STRIDE + int(backward) * _KIND_STRIDE + stream


def event_slot(device_index: int, event: int) -> int:
    """Return the table index of event number ``event`` of a device."""
    return TABLE_BASE + device_index * _DEVICE_STRIDE + EVENT_OFFSET + event


@dataclass(frozen=True)
class StreamOptions:
    """What the stamping pass schedules with; all of it goes into the pass's uuid."""

    streams: int | tuple[int, ...] = 4   # several counts (streams="auto"): the prediction chooses among them
    scheduler: str = "critical_path"
    roofline: Roofline | None = None     # None: the route's caller must set one (the backend does)
    min_predicted_speedup: float = decide.MIN_SPEEDUP
    # Stamp CPU graphs too, without events (CPU codegen ignores streams except as fusion
    # boundaries): for tests and to read the stamps; off, CPU graphs are left as they are.
    stamp_cpu: bool = False
    # Insert events: None where the device has streams; True also on CPU, where the code can be
    # generated and read but not run (CPU has no events).
    syncs: bool | None = None
    # Issue kernels in the schedule's order: the fx graph is put in that order and inductor's
    # reordering for peak memory is off while the graph compiles (on, it issued a stream-0
    # consumer before a third branch's matmul in the CPU test). Unmeasured either way on a GPU.
    keep_order: bool = True


@dataclass(frozen=True)
class StampResult:
    """What the pass did to one graph (kept on the pass for inspection and tests)."""

    num_nodes: int
    num_streams: int
    num_events: int = 0
    num_waits: int = 0
    num_record_streams: int = 0
    ideal_speedup: float = 1.0
    predicted_speedup: float = 1.0
    reason: str | None = None                      # why the graph was left on one stream
    stream_of: Mapping[str, int] = field(default_factory=dict, hash=False)


# -- planning: which stream each fx node runs on -------------------------------------------------


def plan_streams(graph: fx.Graph, options: StreamOptions) -> tuple[dict[str, int], tuple[str, ...], StampResult]:
    """Return (stream per call_function node name, issue order, summary); no streams keep the graph on one.

    The issue order is the schedule's, over the DAG's nodes (``getitem``
    unpacks are not in it: they follow their op).

    Ops that do no arithmetic follow their data: a ``getitem`` or a view runs
    on the stream of the op whose output it unpacks or aliases, and a view of
    a graph input on the stream of its first reader, so no event is spent on
    an op that launches nothing.
    """
    if options.roofline is None:
        raise ValueError("StreamOptions.roofline must be set")
    roof = options.roofline
    calls = [n for n in graph.nodes if n.op == "call_function"]
    dag = build_aten_dag(graph, roof)
    counts = decide.stream_counts(options.streams)
    if counts == (1,) or dag.number_of_nodes() < 2:
        return {}, (), StampResult(len(calls), 1, reason="one stream")
    candidates = [s for s in decide.distinct_schedules(dag, counts, options.scheduler,
                                                       decide.MIN_CLUSTER_LAUNCHES * roof.kernel_overhead_us)
                  if s.num_streams > 1 and s.makespan > 0]
    if not candidates:
        return {}, (), StampResult(len(calls), 1, reason="the schedule uses one stream")
    # the prediction decides here: timing the one-stream program would take a second compile
    predictions = [decide.predict(dag, s) for s in candidates]
    decision = decide.choose(f"a stamped graph of {len(calls)} ops", predictions,
                             min_speedup=options.min_predicted_speedup)
    schedule, prediction = candidates[decision.candidate], decision.prediction
    ideal, predicted = prediction.ideal_speedup, prediction.speedup
    if not decision.keep:
        return {}, (), StampResult(len(calls), 1, ideal_speedup=ideal, predicted_speedup=predicted,
                                   reason=decision.reason)
    problems = schedulers.validate(dag, schedule)
    if problems:
        raise ValueError(f"invalid schedule (a concur bug, please report it): {problems[:3]}")
    stream = {name: int(s) for name, s in schedule.stream.items()}
    for n in calls:  # forward: unpacks and views of an op's output follow that op
        if is_unpack(n) or is_view(n):
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            src = root(src) if src is not None else None
            if src is not None and src.op == "call_function" and src.name in stream:
                stream[n.name] = stream[src.name]
    for n in reversed(calls):  # views of graph inputs: the stream of their first reader
        if n.name not in stream or (is_view(n) and not _reads_an_op(n)):
            readers = [stream[u.name] for u in n.users if u.name in stream]
            stream[n.name] = readers[0] if readers else stream.get(n.name, 0)
    used = sorted(set(stream.values()))
    return stream, tuple(schedule.order), StampResult(len(calls), len(used), ideal_speedup=ideal,
                                                     predicted_speedup=predicted, stream_of=dict(stream))


def _reads_an_op(n: fx.Node) -> bool:
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    return src is not None and root(src).op == "call_function"


# -- rewriting: stamps and syncs -----------------------------------------------------------------


def _is_graph_input(n: fx.Node) -> bool:
    return n.op in ("placeholder", "get_attr")


def _tensor_valued(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def existing_stream_annotations(graph: fx.Graph) -> str | None:
    """Return why the graph already carries streams (user streams or events), or None."""
    ops = compat.inductor_stream_ops()
    for n in graph.nodes:
        if isinstance(n.meta.get("custom"), dict) and "stream" in n.meta["custom"]:
            return f"node {n.name} already has a stream annotation (user streams)"
        if n.op == "call_function" and (n.target in ops.sync_ops or n.target is ops.control_deps):
            return f"node {n.name} is a stream sync op ({n.target})"
    return None


class _Rewriter:
    """Inserts the stamps and the syncs of one planned graph (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, stream: Mapping[str, int], device_index: int, backward: bool,
                 syncs: bool):
        self.gm, self.graph = gm, gm.graph
        self.stream = dict(stream)
        self.device_index, self.backward, self.syncs = device_index, backward, syncs
        self.ops = compat.inductor_stream_ops()
        self.num_events = self.num_waits = self.num_record_streams = 0

    def slot(self, s: int) -> int:
        return stream_slot(self.device_index, self.backward, s)

    def stamp(self, n: fx.Node, s: int) -> None:
        if s != CALLER:  # unstamped nodes run on inductor's default stream: the caller's
            custom = n.meta.setdefault("custom", {})
            custom["stream"] = self.slot(s)

    def new_event(self) -> int:
        if self.num_events >= MAX_EVENTS:
            raise ValueError(f"the graph needs more than {MAX_EVENTS} events")
        self.num_events += 1
        return event_slot(self.device_index, self.num_events - 1)

    def sync(self, op: Any, op_args: tuple, deps: Sequence[fx.Node], passthrough: Sequence[fx.Node],
             where: fx.Node, s: int) -> tuple[fx.Node, list[fx.Node]]:
        """Insert ``control_deps(deps, op(*op_args), *passthrough)`` before ``where``, on stream ``s``.

        Returns the control_deps node and one getitem per pass-through value.
        """
        graph = self.graph
        with graph.inserting_before(where):
            raw = graph.call_function(op, op_args)
        raw.meta["val"] = None
        self.stamp(raw, s)  # the subgraph's copy is what inductor lowers, inside this stream
        sub = self.ops.create_subgraph_for_node(graph, raw, list(passthrough))
        attr = self.ops.get_subgraph_name(self.gm, raw.name)
        setattr(self.gm, attr, sub)
        with graph.inserting_before(raw):
            get = graph.get_attr(attr)
            node = graph.call_function(self.ops.control_deps, (tuple(deps), get, *passthrough))
        graph.erase_node(raw)
        out = sub.graph.output_node().meta.get("val")
        node.meta["val"] = out if isinstance(out, tuple) else (out,)
        self.stamp(node, s)
        items = []
        with graph.inserting_after(node):
            for i, dep in enumerate(passthrough):
                item = graph.call_function(operator.getitem, (node, i + 1))
                item.meta.update({k: v for k, v in dep.meta.items() if k not in ("custom", "unbacked_bindings")})
                self.stamp(item, s)
                items.append(item)
        return node, items

    def check(self, hazards: Sequence[tuple[str, str]]) -> None:
        """Raise ValueError, before anything is changed, if the rewrite would fail."""
        if not self.syncs:
            return
        nodes = {n.name: n for n in self.graph.nodes}
        for u_name, v_name in hazards:
            u, v = nodes.get(u_name), nodes.get(v_name)
            if u is None or v is None or self.stream.get(u.name, CALLER) == self.stream.get(v.name, CALLER):
                continue
            if not any(_tensor_valued(a) and not self._written_by(v, a) for a in v.all_input_nodes):
                raise ValueError(f"cannot order {v.name} after {u.name} across streams (it reads no tensor "
                                 "it does not write)")
        producers = {x for v in self.graph.nodes if v.op == "call_function" for x in v.all_input_nodes
                     if self.stream.get(x.name, CALLER) != self.stream.get(v.name, CALLER)}
        needed = len(producers) + len(hazards) + len(set(self.stream.values())) + 1
        if needed > MAX_EVENTS:
            raise ValueError(f"the graph may need {needed} events, more than concur keeps ({MAX_EVENTS})")

    def rewrite(self, hazards: Sequence[tuple[str, str]]) -> None:
        graph = self.graph
        nodes = {n.name: n for n in graph.nodes}
        calls = [n for n in graph.nodes if n.op == "call_function"]
        for n in calls:
            self.stamp(n, self.stream.get(n.name, CALLER))
        if not self.syncs:
            return
        output = graph.output_node()
        # reads[(value, stream)] = the readers on that stream of a value made elsewhere
        reads: dict[tuple[fx.Node, int], list[fx.Node]] = {}
        for v in calls:
            s = self.stream.get(v.name, CALLER)
            for x in v.all_input_nodes:
                if _is_graph_input(x):
                    if s != CALLER:
                        reads.setdefault((x, s), []).append(v)
                elif x.op == "call_function" and self.stream.get(x.name, CALLER) != s:
                    reads.setdefault((x, s), []).append(v)
        order = {n: i for i, n in enumerate(graph.nodes)}
        # 1. fork: side streams wait on the caller's stream before reading graph inputs
        inputs_on: dict[int, list[fx.Node]] = {}
        for (x, s) in reads:
            if _is_graph_input(x):
                inputs_on.setdefault(s, []).append(x)
        if inputs_on:
            fork_inputs = list(dict.fromkeys(x for xs in inputs_on.values() for x in xs))
            anchor = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
            event = self.new_event()
            record, _ = self.sync(self.ops.record_event, (event, self.slot(CALLER)), fork_inputs, (), anchor, CALLER)
            for s, xs in sorted(inputs_on.items()):
                _, items = self.sync(self.ops.wait_event, (event, self.slot(s)), (record,), xs, anchor, s)
                self.num_waits += 1
                for x, item in zip(xs, items):
                    self._rewire(x, item, reads[(x, s)])
                    self._record_stream(x, s, anchor)
        # 2. values read on another stream: record after the value, wait before its first reader there
        recorded: dict[fx.Node, fx.Node] = {}
        events: dict[fx.Node, int] = {}
        for (x, s), readers in sorted(((k, r) for k, r in reads.items() if not _is_graph_input(k[0])),
                                      key=lambda kv: (order[kv[0][0]], kv[0][1])):
            if x not in recorded:
                events[x] = self.new_event()
                recorded[x], _ = self.sync(self.ops.record_event, (events[x], self.slot(self.stream[x.name])),
                                           (x,), (), x.next, self.stream[x.name])
            first_reader = min(readers, key=order.__getitem__)
            _, (item,) = self.sync(self.ops.wait_event, (events[x], self.slot(s)), (recorded[x],), (x,),
                                   first_reader, s)
            self.num_waits += 1
            self._rewire(x, item, readers)
            if _tensor_valued(x):
                self._record_stream(_storage(x), s, first_reader)
        # 3. ordering edges (mutations, random ops) across streams, with no data edge to carry them
        for u_name, v_name in hazards:
            u, v = nodes.get(u_name), nodes.get(v_name)
            if u is None or v is None:
                continue
            su, sv = self.stream.get(u.name, CALLER), self.stream.get(v.name, CALLER)
            if su == sv or u in v.all_input_nodes:
                continue
            carrier = next((a for a in v.all_input_nodes if _tensor_valued(a) and not self._written_by(v, a)), None)
            if carrier is None:
                raise ValueError(f"cannot order {v.name} after {u.name} across streams (it reads no tensor "
                                 "it does not write)")
            if u not in recorded:
                events[u] = self.new_event()
                recorded[u], _ = self.sync(self.ops.record_event, (events[u], self.slot(su)), (u,), (), u.next, su)
            _, (item,) = self.sync(self.ops.wait_event, (events[u], self.slot(sv)), (recorded[u],), (carrier,), v, sv)
            self.num_waits += 1
            self._rewire(carrier, item, [v])
        # 4. join: the caller's stream waits on every side stream before the call returns. A sink
        # already ordered before a wait of the caller's stream (its value is read there) needs none.
        joined = self._before_caller_waits()
        for s in sorted(set(self.stream.values()) - {CALLER}):
            on_s = [n for n in graph.nodes if n.op == "call_function" and self.stream.get(n.name) == s
                    and n.target is not self.ops.control_deps]
            sinks = [n for n in on_s if not any(self.stream.get(u.name) == s for u in n.users)]
            if all(n in joined for n in sinks):
                continue
            event = self.new_event()
            record, _ = self.sync(self.ops.record_event, (event, self.slot(s)), sinks, (), output, s)
            self.sync(self.ops.wait_event, (event, self.slot(CALLER)), (record,), (), output, CALLER)
            self.num_waits += 1
        graph.lint()
        self.gm.recompile()

    def _before_caller_waits(self) -> set[fx.Node]:
        """Return the nodes inductor must order before some wait of the caller's stream (fx ancestors)."""
        caller = self.slot(CALLER)
        frontier = [n for n in self.graph.nodes if n.op == "call_function" and n.target is self.ops.control_deps
                    and self._wait_stream(n) == caller]
        seen: set[fx.Node] = set(frontier)
        while frontier:
            for a in frontier.pop().all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    frontier.append(a)
        return seen

    def _wait_stream(self, node: fx.Node) -> int | None:
        """Return the stream slot a control_deps node waits on, or None if it wraps no wait_event."""
        sub = getattr(self.gm, node.args[1].target, None) if isinstance(node.args[1], fx.Node) else None
        ops = [m for m in sub.graph.nodes if m.op == "call_function"] if sub is not None else []
        return ops[0].args[1] if len(ops) == 1 and ops[0].target is self.ops.wait_event else None

    @staticmethod
    def _written_by(v: fx.Node, a: fx.Node) -> bool:
        schema = compat.op_schema(v.target)
        if schema is None:
            return False
        for arg, value in zip(schema.arguments, v.args):
            if value is a and arg.alias_info is not None and arg.alias_info.is_write:
                return True
        return any(v.kwargs.get(arg.name) is a for arg in schema.arguments
                   if arg.alias_info is not None and arg.alias_info.is_write)

    @staticmethod
    def _rewire(x: fx.Node, item: fx.Node, readers: Sequence[fx.Node]) -> None:
        for r in readers:
            r.args = fx.node.map_arg(r.args, lambda a: item if a is x else a)
            r.kwargs = fx.node.map_arg(r.kwargs, lambda a: item if a is x else a)

    def _record_stream(self, x: fx.Node, s: int, where: fx.Node) -> None:
        """Tell the caching allocator that stream ``s`` reads ``x``: its memory is reused only after ``s`` is past it."""
        if not _tensor_valued(x):
            return
        if x.op == "call_function" and self.stream.get(x.name, CALLER) == s:
            return
        key = (x, s)
        done = self.__dict__.setdefault("_recorded_streams", set())
        if key in done:
            return
        done.add(key)
        with self.graph.inserting_before(where):
            n = self.graph.call_function(self.ops.record_stream, (x, self.slot(s)))
        n.meta["val"] = None
        self.stamp(n, s)
        self.num_record_streams += 1


def _storage(x: fx.Node) -> fx.Node:
    """Return the node whose tensor ``x`` views (its allocation); an unpacked output is its own."""
    while x.op == "call_function" and is_view(x) and x.args and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def reorder(graph: fx.Graph, order: Sequence[str]) -> None:
    """Put the graph's ops in the schedule's issue order, each ``getitem`` right after the op it unpacks.

    Inductor issues kernels in about the fx order (its scheduler keeps
    dependencies, and may still move nodes, e.g. for peak memory), so this is
    how the host issues a long branch's first kernel before a short one's.
    ``order`` is a topological order of the DAG, whose edges hold every data
    and ordering dependency, so the graph stays valid.
    """
    calls = [n for n in graph.nodes if n.op == "call_function"]
    by_name = {n.name: n for n in calls}
    unpacks: dict[fx.Node, list[fx.Node]] = {}
    for n in calls:
        if is_unpack(n):
            unpacks.setdefault(root(n), []).append(n)
    placed = [m for name in order for m in (by_name[name], *unpacks.get(by_name[name], ()))]
    if len(placed) != len(calls) or set(placed) != set(calls):
        raise ValueError("the schedule's order does not cover the graph's ops")
    for n in [n for n in graph.nodes if n.op == "get_attr"]:  # constants first, so any op may follow them
        calls[0].prepend(n)
    cursor = calls[0].prev
    for n in placed:
        cursor.append(n)
        cursor = n


class GraphChanged(RuntimeError):
    """The stamping failed after it had changed the graph: inductor must not lower that graph."""


def graph_device(gm: fx.GraphModule) -> torch.device | None:
    """Return the one device the graph's tensors live on, or None if several (or none).

    CPU scalars beside another device's tensors (constants, step counters) do
    not count: they are arguments, not work.
    """
    values = [v for n in gm.graph.nodes for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)]
    devices = {v.device for v in values} - {torch.device("meta")}
    if len(devices) > 1:
        devices = {v.device for v in values if not (v.device.type == "cpu" and v.dim() == 0)} - {torch.device("meta")}
    return next(iter(devices)) if len(devices) == 1 else None


def stamp_graph(gm: fx.GraphModule, options: StreamOptions, backward: bool = False) -> StampResult:
    """Stamp a post-grad aten graph with concur's streams and insert the syncs; return what was done.

    ``options.syncs=None`` inserts events only on devices with streams (CUDA-like);
    CPU graphs are stamped without them when ``options.stamp_cpu``, and left
    alone otherwise. The graph is left untouched (one stream) when it
    already carries streams, spans several devices, or the schedule is not
    worth it.

    Raises:
        ValueError: the graph cannot be stamped; it is unchanged.
        GraphChanged: the rewrite failed after changing the graph.
    """
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    reason = existing_stream_annotations(gm.graph)
    if reason is not None:
        return StampResult(calls, 1, reason=reason)
    device = graph_device(gm)
    if device is None:
        return StampResult(calls, 1, reason="the graph's tensors are on several devices, or none")
    has_streams = compat.device_has_streams(device)
    syncs = options.syncs
    if not has_streams and not options.stamp_cpu and not syncs:
        return StampResult(calls, 1, reason=f"{device.type} has no streams")
    stream, order, result = plan_streams(gm.graph, options)
    if not stream:
        return result
    if syncs is None:
        syncs = has_streams
    dag = build_aten_dag(gm.graph, options.roofline)
    hazards = [(u, v) for u, v, kind in dag.edges(data="kind") if kind == "hazard"]
    rewriter = _Rewriter(gm, stream, device.index or 0, backward, syncs)
    rewriter.check(hazards)
    if options.keep_order:
        reorder(gm.graph, order)  # checks before it moves a node; moving cannot fail half-way
    try:
        rewriter.rewrite(hazards)
    except Exception as exc:
        raise GraphChanged(f"the stream rewrite failed half-way (a concur bug, please report it): "
                           f"{type(exc).__name__}: {exc}") from exc
    return StampResult(result.num_nodes, result.num_streams, rewriter.num_events, rewriter.num_waits,
                       rewriter.num_record_streams, result.ideal_speedup, result.predicted_speedup, None,
                       result.stream_of)


# -- the pass inductor runs, and the objects its code looks up -----------------------------------


def make_stamp_pass(options: StreamOptions, backward: bool = False) -> Any:
    """Return an inductor ``CustomGraphPass`` that stamps each graph it sees (see :func:`stamp_graph`).

    Its ``uuid`` hashes the sources the stamps depend on and the options, so
    inductor's FX graph cache keys on them: a cached graph was stamped by the
    same code with the same options. ``pass.results`` lists what it did, one
    :class:`StampResult` per graph it ran on (nothing on a cache hit).
    """
    base = compat.custom_graph_pass_base()

    class StreamStampPass(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self.options, self.backward = options, backward
            self.results: list[StampResult] = []
            # inductor runs post-grad passes on a graph's subgraphs (HOP bodies) too; with a module
            # set here, only that module's own graph is stamped
            self.only: fx.GraphModule | None = None

        def __call__(self, graph: fx.Graph) -> None:
            gm = graph.owning_module
            if self.only is not None and gm is not self.only:
                return
            if gm is None:
                self.results.append(StampResult(0, 1, reason="the graph has no owning module"))
                return
            try:
                self.results.append(stamp_graph(gm, self.options, self.backward))
            except GraphChanged:
                raise  # a half-stamped graph must not reach lowering: the caller compiles a snapshot
            except Exception as exc:  # noqa: BLE001 - the graph is unchanged: it runs as inductor makes it
                calls = sum(1 for n in graph.nodes if n.op == "call_function")
                self.results.append(StampResult(calls, 1, reason=f"{type(exc).__name__}: {exc}"[:300]))

        def uuid(self) -> bytes:
            return compat.hash_for_files(_SOURCES, extra=f"{self.options!r} backward={self.backward}")

    return StreamStampPass()


def _sources() -> tuple[str, ...]:
    import os

    import schedulers as pkg

    here = os.path.dirname(__file__)
    sched = os.path.dirname(pkg.__file__)
    files = [os.path.join(here, f) for f in ("stamp.py", "aten_dag.py", "../dag/cost.py", "../dag/hazards.py",
                                             "../dag/annotate.py", "../dag/decide.py")]
    files += sorted(os.path.join(sched, f) for f in os.listdir(sched) if f.endswith(".py"))
    return tuple(files)


_SOURCES = _sources()


class _DeviceObjects:
    """concur's side streams and events of one device, kept alive for the table's weak references.

    Side streams are made only as needed (``streams - 1`` per kind): they come
    from torch's round-robin pool of 32 per device, and forward and backward
    streams must stay distinct for the allocator argument in the module
    docstring.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index or 0
        self.streams: dict[tuple[bool, int], torch.Stream] = {}
        self.events = [torch.Event(device=device) for _ in range(MAX_EVENTS)]
        self.table = compat.ExternalObjects()
        for j, event in enumerate(self.events):
            self.table.add(event_slot(self.index, j), event)

    def ensure(self, streams: int) -> None:
        for kind in (False, True):
            for s in range(1, min(streams, MAX_STREAMS)):
                if (kind, s) not in self.streams:
                    self.streams[(kind, s)] = stream = torch.Stream(device=self.device)
                    self.table.add(stream_slot(self.index, kind, s), stream)

    @staticmethod
    @functools.cache
    def of(device: torch.device) -> "_DeviceObjects":
        """Return the device's one set in this process: every graph's code (cached too) fetches the same indices."""
        return _DeviceObjects(device)


class StreamTableCall:
    """A compiled graph behind a step that puts concur's streams and events in dynamo's table first.

    Boxed like inductor's output (one list argument). The caller-stream
    entry is set on every call: inductor's code records and waits on the
    stream current when it is called.
    """

    def __init__(self, compiled: Callable, device: torch.device, streams: int):
        self.compiled = compiled
        self.device = device
        compat.mark_boxed(self)
        self.objects = _DeviceObjects.of(device)
        self.objects.ensure(streams)
        self.caller_slot = stream_slot(device.index or 0, False, CALLER)

    def __call__(self, args: list) -> Any:
        caller = torch.accelerator.current_stream(self.device)
        with self.objects.table.installed({self.caller_slot: caller}):
            return self.compiled(args)

    def __getattr__(self, name: str) -> Any:  # inductor's attributes (e.g. source_code) stay readable
        if name == "compiled":  # not set yet (e.g. while copying): no recursion
            raise AttributeError(name)
        return getattr(self.compiled, name)


# -- the backend's route -------------------------------------------------------------------------

ROUTES = ("wrapper", "inductor_streams")
# Stamp CPU graphs too (no events; the generated code's stream names are bound to no-op contexts):
# for tests, which can then train through stamped graphs on CPU. Off: CPU graphs are left alone.
STAMP_CPU = False


@dataclass(frozen=True)
class StampedCompile:
    """Inductor's output for one graph compiled with the stamping pass, and what the pass did."""

    compiled: Any
    result: StampResult | None  # None: the pass did not run (inductor's FX graph cache had the graph)


def compile_stamped(gm: fx.GraphModule, example_inputs: Sequence[Any], options: StreamOptions,
                    is_backward: bool, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> StampedCompile:
    """Compile one aten graph with inductor, the stamping pass last among its post-grad passes.

    On a device with streams the result is wrapped in :class:`StreamTableCall`
    (on a cache hit too: the cached code reads the same table indices).

    Raises:
        Exception: whatever inductor or the pass raised; the caller compiles without the pass.
    """
    options = dataclasses.replace(options, stamp_cpu=options.stamp_cpu or STAMP_CPU)
    stamp_pass = make_stamp_pass(options, is_backward)
    stamp_pass.only = gm
    with compat.post_grad_custom_post_pass(stamp_pass), \
            compat.inductor_peak_memory_reordering(False) if options.keep_order else contextlib.nullcontext():
        compiled = compat.inductor_compile_graph(gm, list(example_inputs), *args, **dict(kwargs or {}))
    result = stamp_pass.results[-1] if stamp_pass.results else None
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    if compat.device_has_streams(device):
        return StampedCompile(StreamTableCall(compiled, device, options.streams), result)
    if options.stamp_cpu:
        # inductor's CPU wrapper enters `with default_stream:` / `with streamN:` it never defines
        compat.bind_wrapper_names(compiled, {name: contextlib.nullcontext()
                                             for name in compat.inductor_stream_names(MAX_STREAMS)})
    return StampedCompile(compiled, result)


def snapshot_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Return a copy of ``gm`` whose nodes inductor's in-place post-grad passes do not touch.

    Kept before a stamped compile, so a failure can compile the graph as
    AOTAutograd gave it. Metadata dicts are copied, their values (fake
    tensors) shared; so are the module's attributes.
    """
    graph = copy.deepcopy(gm.graph)
    graph.output_node().meta = copy.copy(gm.graph.output_node().meta)
    return fx.GraphModule(gm, graph)

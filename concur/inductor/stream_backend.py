"""``torch.compile(model, backend="concur")``: inductor's fused kernels, issued on several streams.

Inductor's front end runs unchanged (dynamo capture, decompositions,
AOTAutograd with its min-cut partitioner), and inductor compiles each forward
and backward aten graph whole, exactly as ``backend="inductor"`` would. concur
then rewrites only the order and the streams of the kernel launches in the
generated ``call`` (:mod:`concur.inductor.wrapper_emit`): fusion, layouts and the
kernels themselves are inductor's.

A graph with nothing to put on streams (fewer than two launches,
``streams=1``, a schedule that uses one stream, a predicted gain below
``min_predicted_speedup``, or on CUDA a plan measured no faster than
inductor's own call: :mod:`concur.dag.decide`) runs inductor's own call
without a warning; the reason is kept in :attr:`ConcurBackend.graphs`. A graph concur cannot
schedule (symbolic shapes, a wrapper it does not fully read, a plan its
barriers serialize) runs inductor's own call too, with one warning naming
why; results never differ from inductor's.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import schedulers

from concur import _torch_compat as compat
from concur.dag import decide
from concur.dag.cost import Roofline, roofline_for
from concur.dag.disk_cache import JsonCache
from concur.dag.measure import boxed_timer, can_time, environment
from concur.inductor.aten_dag import build_aten_dag
from concur.inductor.backward_split import split_calls, split_convolution_backward, weight_gradient_nodes
from concur.inductor.first_call import FirstCallTiming
from concur.inductor.placement import InstalledPlan, PlacedKernels, place_kernels
from concur.inductor.stamp import ROUTES, StreamOptions, compile_stamped, snapshot_graph

__all__ = ["BackendOptions", "CompiledGraphInfo", "ConcurBackend", "costs_by_source", "backend", "concur_backend"]

# Placing kernels loses no fusion, so a plan is installed unless it is predicted slower than one stream.
DEFAULT_MIN_PREDICTED_SPEEDUP = decide.MIN_SPEEDUP

BUFFER_REUSE_ORDERED = "ordered"  # inductor's reuse, kept where the schedule orders it (BackendOptions.buffer_reuse)

# the steps a backward graph's program goes down where the step does not fit in memory (ConcurBackend.narrow_plans)
TWO_STREAMS, LEAN, ONE_STREAM = "2 streams", "aten's calls on the caller's stream", "1 stream"
NARROWING = (TWO_STREAMS, LEAN, ONE_STREAM)


@dataclass(frozen=True)
class BackendOptions:
    """How the concur backend schedules and compiles."""

    # up to this many streams; "auto": the schedules on 2, 3 and 4 streams (decide.AUTO_STREAMS), chosen among by
    # the one decision point (measured on CUDA, predicted elsewhere) with one stream, from one compile
    streams: int | str = 4
    scheduler: str = "critical_path"
    roofline: Roofline | None = None  # default: from the device of the graph's inputs
    # A graph whose schedule predicts less than this gain over one stream, with kernels sharing the
    # device (schedulers.simulate_shared), keeps inductor's own call.
    min_predicted_speedup: float = DEFAULT_MIN_PREDICTED_SPEEDUP
    # With streams > 1: what happens to inductor's reuse of a dead buffer's memory. Each reuse
    # orders the new buffer's writer after every reader of the old one, which chains independent
    # branches (an 8-branch net's planned backward: ideal 1.04x with reuse, 3.09x without).
    # "ordered" (default): inductor reuses, the launches are scheduled as without reuse, and a reuse
    # is kept only where that schedule orders the two buffers anyway, else it becomes a fresh
    # allocation: the plan keeps all of its concurrency and inductor's reuse wherever that costs none of
    # it, so it runs as fast as False in less memory. False: no reuse.
    # True: inductor's reuse, chains and all. streams=1 keeps inductor's own setting. On the
    # inductor_streams route inductor itself reuses only within a stream, so "ordered" is its reuse
    # where compat confirms that, and no reuse elsewhere.
    buffer_reuse: bool | str = "ordered"
    # "wrapper": inductor compiles each graph whole and concur rewrites its generated call
    # (concur.inductor.wrapper_emit). "inductor_streams": concur stamps its schedule onto the post-grad
    # aten graph and inductor emits the streams and events itself (concur.inductor.stamp;
    # torch >= 2.13, elsewhere the wrapper route with one warning). Tested on CPU only, not yet
    # measured on a GPU, hence not the default.
    route: str = "wrapper"
    # With streams > 1: split each backward convolution_backward into its input-gradient and
    # weight(+bias)-gradient calls (concur.inductor.backward_split), so the weight part can leave the
    # critical path for a side stream. Same kernels, one more launch per convolution. The wrapper
    # route splits only the program it puts on streams (concur.inductor.wrapper_split): a graph kept
    # on one stream runs inductor's own joint calls.
    split_weight_grads: bool = True
    # On CUDA, the wrapper route times inductor's own call against the rewritten one (CUDA graphs,
    # alternating replays) before it keeps a plan the prediction let through, and keeps the faster;
    # the answer is cached on disk (concur.dag.decide, concur.dag.measure). False: the prediction decides.
    measure: bool = True


@dataclass(frozen=True)
class CompiledGraphInfo:
    """What the backend did with one forward or backward graph (kept for inspection and tests)."""

    is_backward: bool
    num_ops: int
    num_launches: int  # kernel launches of inductor's wrapper (0 when it was not read)
    num_streams: int
    num_waits: int
    # why concur could not schedule the graph (it runs inductor's own call; warned once), else None
    fallback_reason: str | None
    ideal_speedup: float = 1.0
    predicted_speedup: float = 1.0
    num_barriers: int = 0  # launches concur could not read, ordered after and before all others
    # why a graph concur could read runs on one stream all the same (a decision, not a failure)
    one_stream_reason: str | None = None
    convolutions_split: int = 0  # convolution_backward calls split into input and weight parts
    weight_grad_ops: int = 0  # matmuls and convolution backward calls whose values only the optimizer reads
    # inductor's reuse lines (a new buffer in a dead one's memory) in what runs: kept as written, or
    # made fresh allocations because the streams do not order the two buffers (buffer_reuse="ordered")
    reuses_kept: int = 0
    reuses_fresh: int = 0
    # what the keep-or-drop decision rested on: "prediction", "measurement" or "cache" ("" if none was made;
    # "pending" until the graph's first call, which times both programs on its inputs); "step measurement" or
    # "step cache" where train_step's decision over the whole step dropped a plan this graph kept
    # (concur.training.step_streams); "memory" where the step with it did not fit (ConcurBackend.narrow_plans)
    decided_by: str = ""
    measured_speedup: float | None = None  # one stream's measured time over the plan's, where it was timed


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _roofline(options: BackendOptions, example_inputs: Sequence[Any]) -> Roofline:
    if options.roofline is not None:
        return options.roofline
    device = _device_of(example_inputs)
    return roofline_for(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


DYNAMIC_SHAPES = ("the graph has dynamic (symbolic) shapes; concur schedules static shapes only "
                  "(compile with dynamic=False and without torch._dynamo.mark_dynamic)")


class ConcurBackend:
    """A dynamo backend: ``torch.compile(model, backend=ConcurBackend(BackendOptions(...)))``."""

    def __init__(self, options: BackendOptions = BackendOptions()):
        if options.streams != decide.AUTO and (isinstance(options.streams, bool) or not isinstance(options.streams, int)
                                        or options.streams < 1):
            raise ValueError(f"streams must be a positive int or 'auto', got {options.streams!r}")
        if options.scheduler not in schedulers.SCHEDULERS:
            raise ValueError(f"unknown scheduler {options.scheduler!r}; choose one of "
                             f"{sorted(schedulers.SCHEDULERS)}")
        if options.route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {options.route!r}")
        if not options.min_predicted_speedup >= 1.0:
            raise ValueError(f"min_predicted_speedup must be >= 1.0, got {options.min_predicted_speedup!r}")
        if not (isinstance(options.buffer_reuse, bool) or options.buffer_reuse == BUFFER_REUSE_ORDERED):
            raise ValueError(f"buffer_reuse must be True, False or 'ordered', got {options.buffer_reuse!r}")
        self.options = options
        self.graphs: list[CompiledGraphInfo] = []
        self._warned: set[str] = set()
        # index in ``graphs`` -> the multi-stream program installed there (the wrapper route's), until
        # train_step weighs it over the whole step (concur.training.step_streams)
        self._installed: dict[int, InstalledPlan] = {}
        # index in ``graphs`` -> every multi-stream program still running, weighed or not: what a step
        # that does not fit in memory can switch off (narrow_plans)
        self._running: dict[int, InstalledPlan] = {}
        # why narrow_plans took the backward graphs' programs down, and to which step of NARROWING
        self._narrowed: tuple[str, str] | None = None

    def __repr__(self) -> str:
        o = self.options
        return f"concur.backend(streams={o.streams}, scheduler={o.scheduler!r})"

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        compat.warn_if_untested_torch()
        return compat.inductor_compile_fx(gm, example_inputs, self._compile)

    # -- per-graph compilation ----------------------------------------------------------------

    def _fall_back(self, is_backward: bool, num_ops: int, reason: str, placed: PlacedKernels | None = None) -> None:
        """Record a graph concur could not schedule, warning once per reason."""
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"concur backend: a {'backward' if is_backward else 'forward'} graph runs as plain "
                          f"inductor output on one stream, because {reason}. Any other graph of this backend "
                          "that falls back for the same reason does so without a new warning (see .graphs).",
                          stacklevel=3)
        plan = placed.plan if placed is not None else None
        self.graphs.append(CompiledGraphInfo(
            is_backward, num_ops, placed.num_launches if placed is not None else 0, 1, 0, reason,
            plan.ideal_speedup if plan else 1.0, plan.predicted_speedup if plan else 1.0,
            plan.num_barriers if plan else 0))

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        """Compile one aten graph whole with inductor, then put its kernel launches on streams."""
        is_backward = bool(kwargs.get("is_backward", False))
        o = self.options
        num_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        if compat.has_symbolic_shapes(list(example_inputs)):
            compiled = compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
            self._fall_back(is_backward, num_ops, DYNAMIC_SHAPES)
            return compiled
        if o.streams == 1:
            compiled = compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
            self.graphs.append(CompiledGraphInfo(is_backward, num_ops, 0, 1, 0, None,
                                                 one_stream_reason="streams=1"))
            return compiled
        weight_grad_ops = len(weight_gradient_nodes(gm.graph)) if is_backward else 0
        recorded = len(self.graphs)
        compiled = self._compile_on_streams(gm, example_inputs, is_backward, num_ops, args, kwargs)
        if len(self.graphs) > recorded:  # the joint calls split, counted where their program runs
            record = self.graphs[-1]
            self.graphs[-1] = dataclasses.replace(record, weight_grad_ops=weight_grad_ops + record.convolutions_split)
        return compiled

    def _compile_on_streams(self, gm: fx.GraphModule, example_inputs: Sequence[Any], is_backward: bool,
                            num_ops: int, args: tuple, kwargs: dict) -> Any:
        o = self.options
        if o.route == "inductor_streams":
            if compat.has_inductor_node_streams():
                return self._compile_stamped(gm, example_inputs, is_backward, num_ops, args, kwargs)
            if "route" not in self._warned:
                self._warned.add("route")
                warnings.warn(f"concur backend: route='inductor_streams' needs inductor's node streams (torch >= "
                              f"2.13); torch {torch.__version__} has none, so the wrapper route is used", stacklevel=2)
        try:  # costs come from the fx graph, which inductor's post-grad passes rewrite in place
            roof = _roofline(o, example_inputs)
            node_costs = costs_by_source(gm.graph, build_aten_dag(gm.graph, roof))
            splits = split_calls(gm.graph, roof) if is_backward and o.split_weight_grads else {}
        except Exception as exc:  # noqa: BLE001 - any failure here means: run inductor's output as it is
            compiled = compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
            self._fall_back(is_backward, num_ops, f"its costs could not be read ({_describe(exc)})")
            return compiled
        # "ordered" needs inductor's reuse lines to decide which of them the schedule can keep
        ordered = o.buffer_reuse == BUFFER_REUSE_ORDERED
        with _inductor_reuse(o.buffer_reuse, ordered_reuses=True):
            compiled = compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
        record = len(self.graphs)  # this graph's record; a decision made at its first call replaces it

        def on_decided(placed: PlacedKernels) -> None:
            old = self.graphs[record]  # its weight-gradient ops count the split calls of what runs
            self.graphs[record] = dataclasses.replace(old, **_decided(placed), weight_grad_ops=old.weight_grad_ops
                                                      - old.convolutions_split + placed.convolutions_split)
            if placed.installed_plan is not None:
                self._install(record, placed.installed_plan)

        try:
            placed = place_kernels(compiled, node_costs, roof, decide.stream_counts(o.streams), o.scheduler,
                                   o.min_predicted_speedup, split_reuses=ordered,
                                   allocate_on_caller=allocates_on_caller(_device_of(example_inputs)),
                                   label=f"the {'backward' if is_backward else 'forward'} "
                                   f"graph of {num_ops} ops", on_decided=on_decided, weight_grad_split=splits,
                                   **self._measuring(example_inputs, is_backward))
        except Exception as exc:  # noqa: BLE001 - any failure here means: run inductor's output as it is
            self._fall_back(is_backward, num_ops, _describe(exc))
            return compiled
        plan = placed.plan
        if placed.serialized_by is not None:
            s = placed.serialized_by
            self._fall_back(is_backward, num_ops, f"a statement concur cannot read, `{_code(s.node)}` (wrapper "
                            f"line {s.node.lineno}), is ordered after and before every launch, which puts a graph "
                            f"that would use several streams on one", placed)
            return compiled
        self.graphs.append(CompiledGraphInfo(
            is_backward, num_ops, placed.num_launches, ideal_speedup=plan.ideal_speedup if plan else 1.0,
            predicted_speedup=plan.predicted_speedup if plan else 1.0, num_barriers=plan.num_barriers if plan else 0,
            fallback_reason=None, **_decided(placed)))
        if placed.installed_plan is not None:
            self._install(record, placed.installed_plan)
        return compiled

    def _install(self, record: int, plan: InstalledPlan) -> None:
        """Keep ``plan`` (graph ``record``'s) at hand; a backward graph after :meth:`narrow_plans` is narrowed
        as the others were."""
        self._installed[record] = self._running[record] = plan
        if self._narrowed is not None and self.graphs[record].is_backward:
            self._narrow(record, *self._narrowed)

    # -- the decision over the whole step (concur.training.step_streams) -------------------------

    def installed_plans(self) -> list[InstalledPlan]:
        """Return the multi-stream programs installed and not yet weighed over a whole step, in compile order."""
        return [self._installed[i] for i in sorted(self._installed)]

    def use_installed_plans(self, on: bool) -> None:
        """Run each of :meth:`installed_plans` (``on``), or inductor's own call in its place."""
        for plan in self.installed_plans():
            plan.use_streams(on)

    def keep_installed_plans(self) -> None:
        """Leave :meth:`installed_plans` running for good: weighed over the step (or not to be), never again."""
        self._installed.clear()

    def drop_installed_plans(self, reason: str, decided_by: str) -> None:
        """Put :meth:`installed_plans`' graphs back on inductor's call for good, saying why in ``graphs``."""
        self._switch_off(sorted(self._installed), reason, decided_by)

    def running_plans(self) -> list[tuple[CompiledGraphInfo, InstalledPlan]]:
        """Every graph whose multi-stream program runs now, with its switch (``use_streams``), in compile order."""
        return [(self.graphs[i], self._running[i]) for i in sorted(self._running)]

    @property
    def narrowed(self) -> bool:
        """Whether :meth:`narrow_plans` took the backward graphs' programs down."""
        return self._narrowed is not None

    def narrow_plans(self, reason: str) -> str:
        """Take the backward graphs' multi-stream programs one step down, for a step that does not fit in memory;
        return what they run now, in words ("on at most 2 streams", ...), or "" where nothing changed.

        The step's peak is at the start of backward, where the backward's side
        streams allocate gradients beside every saved activation; the forward
        graphs keep their streams. The steps, each one only where it changes
        something: a backward graph on more than 2 streams is placed again on
        2 (one side stream, beside the caller's, allocates what aten makes
        itself and keeps a workspace); then, still on 2, every launch that
        allocates on its own stream (aten's calls: convolutions, their
        workspaces) goes to the caller's stream and only inductor's kernels,
        which write buffers made on the caller's stream, run on the side
        stream, so that it keeps no blocks of its own; then inductor's own
        call. A graph whose schedule at a step is predicted no faster than
        one stream runs inductor's call at once. Nothing recompiles. Backward
        graphs compiled later (a new input shape) get the same at once.
        Returns "", changing nothing, where no forward graph would keep
        streams: then the step needs what one compiled for one stream needs,
        and what this module holds is better given back with it.
        """
        forward = [i for i in self._running if not self.graphs[i].is_backward]
        backward = [i for i in self._running if self.graphs[i].is_backward]
        if not forward or not backward:
            return ""
        placeable = any(self._running[i].fewer_streams is not None for i in backward)
        widest = max(self.graphs[i].num_streams for i in backward)
        done = 0 if self._narrowed is None else NARROWING.index(self._narrowed[1]) + 1
        # the next step that changes something: those that place a graph again need a program to place, and
        # 2 streams a graph on more
        rung = next(r for r in NARROWING[done:]
                    if r == ONE_STREAM or (placeable and (r != TWO_STREAMS or widest > 2)))
        self._narrowed = (reason, rung)
        for i in backward:
            self._narrow(i, reason, rung)
        running = [i for i in backward if i in self._running]
        if not running:
            return "on 1 stream"
        most = max(self.graphs[i].num_streams for i in running)
        return f"on at most {most} streams" + (", aten's calls on the caller's" if rung == LEAN else "")

    def _narrow(self, record: int, reason: str, rung: str) -> None:
        """Take graph ``record``'s program to step ``rung`` of :data:`NARROWING`, for memory."""
        plan = self._running[record]
        g = self.graphs[record]
        if rung == TWO_STREAMS and g.num_streams <= 2:
            return
        fewer = None
        if rung != ONE_STREAM and plan.fewer_streams is not None:
            # lean on 2 too: on more, the caller's stream holds more than on one (on the H200, Inception-v3 b64's
            # backward, lean on 4, missed what it fitted on 1), since a buffer a side stream reads lives until
            # that stream is done with it and inductor's reuse of it is made fresh
            fewer = plan.fewer_streams(2, lean=rung == LEAN)
        if fewer is None:
            self._switch_off([record], reason, "memory")
            return
        self.graphs[record] = dataclasses.replace(g, num_streams=fewer.num_streams, num_waits=fewer.num_waits,
                                                  reuses_kept=fewer.reuses_kept, reuses_fresh=fewer.reuses_fresh,
                                                  decided_by="memory")

    def _switch_off(self, records: Sequence[int], reason: str, decided_by: str) -> None:
        """Put graphs ``records`` back on inductor's call for good, saying why in ``graphs``."""
        for i in records:
            plan = self._running.pop(i, None)  # every installed plan is running until switched off
            self._installed.pop(i, None)
            if plan is None:
                continue
            plan.use_streams(False)
            g = self.graphs[i]  # inductor's call: no waits, no fresh reuses, its convolution backward calls joint
            self.graphs[i] = dataclasses.replace(g, num_streams=1, num_waits=0, one_stream_reason=reason,
                                                 reuses_fresh=0, convolutions_split=0, decided_by=decided_by,
                                                 weight_grad_ops=g.weight_grad_ops - g.convolutions_split)

    def _measuring(self, example_inputs: Sequence[Any], is_backward: bool) -> dict[str, Any]:
        """Return how :func:`place_kernels` times and caches its decision here: nothing without a GPU.

        A plan is timed on the inputs of the graph's first call
        (``first_call``); ``measure``, on inputs made from the fake ones,
        only where inductor does not say which inputs the graph mutates.
        The cache key holds every input's shape, stride and dtype besides the
        wrapper's source (which place_kernels adds), the device and torch, so
        a new batch size, dtype or model is timed afresh; and the options that
        change the program timed for one schedule (buffer reuse, the
        weight-gradient split) and concur's version, which change what is
        emitted from it. It says nothing of when the plan was timed.
        """
        device = _device_of(example_inputs)
        if not self.options.measure or not can_time(device):
            return {}
        inputs = tuple((tuple(x.shape), tuple(x.stride()), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
                       for x in example_inputs)

        def timer(one: Callable[[list], Any], streams: Sequence[Callable[[list], Any]]) -> decide.Timer:
            return boxed_timer(one, streams, example_inputs, device)

        from concur import __version__  # defined once the package's modules, this one among them, are loaded

        emitted_as = (self.options.buffer_reuse, self.options.split_weight_grads, __version__)
        return {"measure": timer, "cache": JsonCache(), "first_call": FirstCallTiming(device, lambda: can_time(device)),
                "key_parts": (is_backward, inputs, environment(device), decide.MARGIN, *emitted_as)}

    def _compile_stamped(self, gm: fx.GraphModule, example_inputs: Sequence[Any], is_backward: bool, num_ops: int,
                         args: tuple, kwargs: dict) -> Any:
        """Compile with concur's schedule stamped on the post-grad graph: inductor emits streams and events."""
        o = self.options
        original = snapshot_graph(gm)  # inductor's post-grad passes change gm in place
        # inductor emits the streams from the graph, so the split is the graph's; if the plan is dropped, the
        # one-stream program is the split one (the wrapper route splits only the program it puts on streams)
        split = split_convolution_backward(gm.graph) if is_backward and o.split_weight_grads else 0
        if split:
            gm.recompile()
        try:
            # "auto": the prediction chooses among the counts (this route's one program per compile is never timed)
            options = StreamOptions(decide.stream_counts(o.streams), o.scheduler, _roofline(o, example_inputs),
                                    o.min_predicted_speedup)
            # inductor emits the streams here, so "ordered" is its reuse where that stays within a stream
            with _inductor_reuse(o.buffer_reuse, ordered_reuses=compat.inductor_reuses_within_streams_only()):
                done = compile_stamped(gm, example_inputs, options, is_backward, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - run the graph as AOTAutograd gave it, on one stream
            compiled = compat.inductor_compile_graph(original, example_inputs, *args, **kwargs)
            self._fall_back(is_backward, num_ops, f"its streams could not be stamped ({_describe(exc)})")
            return compiled
        r = done.result
        self.graphs.append(CompiledGraphInfo(
            is_backward, num_ops, 0, r.num_streams if r else 0, r.num_waits if r else 0, None,
            r.ideal_speedup if r else 1.0, r.predicted_speedup if r else 1.0, 0,
            (r.reason if r else "inductor's FX graph cache had the stamped graph (streams not counted)"),
            convolutions_split=split))
        return done.compiled


def allocates_on_caller(device: torch.device) -> bool:
    """Whether the rewritten calls on ``device`` make every buffer a side stream uses first on the caller's stream
    (:func:`concur.inductor.wrapper_emit.caller_allocations`).

    On CUDA only where captures reuse a dead block other streams used
    (:func:`compat.captures_reuse_cross_stream_blocks`): without that, each
    such buffer would stay held to the end of the step's capture. Elsewhere
    (a CPU, where nothing is captured) the plan is the one a GPU gets.
    """
    return device.type != "cuda" or compat.captures_reuse_cross_stream_blocks()


def _decided(placed: PlacedKernels) -> dict[str, Any]:
    """Return the fields of a graph's :class:`CompiledGraphInfo` that its keep-or-drop decision sets."""
    plan, decision = placed.plan, placed.decision
    return {"num_streams": plan.num_streams if placed.installed else 1,
            "num_waits": plan.num_waits if placed.installed else 0,
            "one_stream_reason": placed.one_stream, "reuses_kept": placed.reuses_kept,
            "reuses_fresh": placed.reuses_fresh, "convolutions_split": placed.convolutions_split,
            "decided_by": "pending" if placed.pending else decision.source if decision else "",
            "measured_speedup": decision.measured.speedup if decision and decision.measured else None}


def _inductor_reuse(buffer_reuse: bool | str, ordered_reuses: bool) -> contextlib.AbstractContextManager:
    """Inductor's reuse setting while it compiles a graph for streams: ``True`` leaves inductor's (and the
    user's) setting, ``False`` turns reuse off, ``"ordered"`` turns it on where ``ordered_reuses`` says the
    route keeps only the reuses its streams order, and off elsewhere."""
    if buffer_reuse is True:
        return contextlib.nullcontext()
    return compat.inductor_buffer_reuse(buffer_reuse == BUFFER_REUSE_ORDERED and ordered_reuses)


def costs_by_source(graph: fx.Graph, dag: Any) -> dict[str, tuple[float, dict]]:
    """Return the fx nodes' (cost, share) under the names inductor lists above each launch.

    Those names are the nodes' sources (:func:`compat.inductor_source_name`),
    not their own: a forward's ``addmm`` is listed as dynamo's ``input_1``.
    Nodes of one source add up; the share is that of the costliest.
    """
    costs: dict[str, tuple[float, dict]] = {}
    top: dict[str, float] = {}
    for node in graph.nodes:
        if node.name not in dag:
            continue
        cost, share = dag.nodes[node.name]["cost"], dag.nodes[node.name]["share"]
        name = compat.inductor_source_name(node)
        total, best = costs.get(name, (0.0, share))
        if cost > top.get(name, -1.0):
            top[name], best = cost, share
        costs[name] = (total + cost, best)
    return costs


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _code(node: ast.stmt) -> str:
    text = ast.unparse(node).splitlines()[0]
    return text if len(text) <= 120 else text[:117] + "..."


def backend(streams: int | str = 4, scheduler: str = "critical_path", *, roofline: Roofline | None = None,
            min_predicted_speedup: float | None = None, buffer_reuse: bool | str = BUFFER_REUSE_ORDERED,
            route: str = "wrapper", split_weight_grads: bool = True, measure: bool = True) -> ConcurBackend:
    """Return a ``torch.compile`` backend putting inductor's fused kernels on up to ``streams`` streams.

    ``torch.compile(model, backend=concur.backend(streams=4))``; the name
    ``"concur"`` is the same with defaults. Inductor compiles each graph
    whole and concur then issues its kernel launches on streams
    (:mod:`concur.inductor.wrapper_emit`): fusion and layout are exactly
    ``torch.compile``'s.

    ``streams="auto"`` schedules each graph on 2, 3 and 4 streams and lets
    the same decision pick among those programs and inductor's own call,
    all from one compile: timed against each other at the graph's first
    call on CUDA (with ``measure``), the fewest streams within 1% of the
    fastest, and one stream unless that is more than 1% faster; without a
    GPU, and on the stamped route, the fewest streams predicted within 3%
    of the best.

    A graph whose schedule predicts less than ``min_predicted_speedup`` over
    one stream (kernels sharing the device) runs on one stream, exactly as
    ``torch.compile`` would; None takes :data:`DEFAULT_MIN_PREDICTED_SPEEDUP`.

    ``buffer_reuse`` decides, for graphs put on several streams, what
    happens to inductor's placing of new buffers in dead ones, a reuse that
    chains independent branches. ``"ordered"`` (the default) compiles with
    inductor's reuse but schedules the launches as without it, then keeps
    each reuse whose two buffers the schedule orders anyway (same stream,
    or through its events) and gives every other one a fresh allocation;
    a reuse whose new buffer's first kernel reads it (an in-place update)
    is always kept. It keeps every concurrency ``False`` has, so it runs as
    fast, and every reuse that costs none, so it needs less memory than
    ``False`` (the figures are in ``experiments/RESULTS.md``). ``True`` keeps inductor's reuse and
    its chains. A graph left on one stream keeps every reuse, exactly as
    ``torch.compile``; the graph records (:attr:`ConcurBackend.graphs`)
    count the reuses kept and made fresh. With ``route="inductor_streams"``
    inductor reuses within a stream only, so ``"ordered"`` is its reuse
    there (where :func:`compat.inductor_reuses_within_streams_only`
    confirms it; no reuse otherwise).

    ``route="inductor_streams"`` (torch >= 2.13; tested on CPU, not measured
    on a GPU) stamps the schedule onto the post-grad graph and lets inductor
    emit streams and events (:mod:`concur.inductor.stamp`) instead of
    rewriting its wrapper.

    ``split_weight_grads=True`` (the default) splits each backward
    convolution into its input-gradient and weight-gradient calls, so the
    weight part can run beside the rest of the backward pass
    (:mod:`concur.inductor.backward_split`); ``False`` keeps AOTAutograd's
    joint calls.

    ``measure=True`` (the default): on CUDA, a plan the prediction lets
    through is timed against inductor's own call of the same compile, both
    in CUDA graphs, in alternating replays, and kept only if its median is
    more than 1% faster (:mod:`concur.dag.decide`); the answer is cached
    per graph, input shapes and dtypes, GPU and torch under
    ``$CONCUR_CACHE_DIR`` (:func:`concur.observe.tune_cache.clear_cache`
    removes it). Without a
    GPU, or with ``False``, the prediction decides. The stamped route
    always lets the prediction decide: its one-stream program would need a
    second compile.
    """
    gate = DEFAULT_MIN_PREDICTED_SPEEDUP if min_predicted_speedup is None else min_predicted_speedup
    return ConcurBackend(BackendOptions(streams, scheduler, roofline, gate, buffer_reuse, route,
                                        split_weight_grads, measure))


def concur_backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
    """The default backend, registered as ``"concur"`` (also via the ``torch_dynamo_backends`` entry point)."""
    return backend()(gm, example_inputs)

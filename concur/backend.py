"""``torch.compile(model, backend="concur")``: inductor's fused kernels, issued on several streams.

Inductor's front end runs unchanged (dynamo capture, decompositions,
AOTAutograd with its min-cut partitioner), so the forward and backward aten
graphs are exactly those ``backend="inductor"`` would compile. concur steps in
at the last stage, where inductor compiles each graph: it

1. builds the graph's DAG with fused-kernel costs (:mod:`concur.aten_dag`),
2. schedules it with the same :mod:`schedulers` as the unfused path,
3. cuts it into per-stream segments (:mod:`concur.segments`) and verifies them,
4. compiles each segment with inductor, keeping traced strides at segment
   boundaries, so no layout conversion is added between segments,
5. returns a runner that issues the compiled segments on their streams.

When the schedule uses one stream (``streams=1``, or a chain-like graph), or
predicts less than ``min_predicted_speedup`` over one stream, the graph goes to
inductor whole: ``streams=1`` is exactly ``torch.compile``. So does a CUDA
graph of NCHW convolutions, with a warning: inductor would make it
channels-last as a whole, and segments cannot (make the model channels-last).
Anything concur cannot schedule, or a segment inductor rejects, falls back to
plain inductor for that graph with one warning naming why; results never
differ from inductor's. ``segment_compiler="eager"`` runs segments as plain
fx code under AOTAutograd (like ``backend="aot_eager"``): the same cutting and
stream logic, fast enough for CPU tests.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import schedulers

from . import _torch_compat as compat
from .aten_dag import build_aten_dag
from .cost import Roofline, roofline_for
from .kernel_streams import place_kernels
from .segments import Segment, SegmentedCall, SegmentPlan, partition, segment_module, verify

SEGMENT_COMPILERS = ("inductor", "eager")
STRATEGIES = ("kernels", "segments")
MIN_SEGMENT_LAUNCHES = 5
# default gate per strategy (BackendOptions.min_predicted_speedup); see its comment
DEFAULT_MIN_PREDICTED_SPEEDUP = {"segments": 1.30, "kernels": 1.0}


@dataclass(frozen=True)
class BackendOptions:
    """How the concur backend schedules and compiles."""

    streams: int = 4
    scheduler: str = "critical_path"
    segment_compiler: str = "inductor"
    # "kernels": inductor compiles each graph whole, then its launches are put on streams
    # (concur.kernel_streams); "segments": the graph is cut per stream and each piece compiled.
    # segment_compiler="eager" always runs segments (there are no inductor kernels to place).
    strategy: str = "kernels"
    roofline: Roofline | None = None  # default: from the device of the graph's inputs
    # Experimental, off: how many kernel launches' worth of work a segment may run past an op
    # another stream waits for, to save a segment (an inductor compilation). On the H100
    # (GoogLeNet bf16 b8, 5 launches) it did not shorten the compile: 181 vs 189 s.
    event_delay_launches: float = 0.0
    # A graph whose schedule predicts less than this gain over one stream, with kernels sharing the
    # device (schedulers.simulate_shared), goes to inductor whole: segments cost fusion across their
    # boundaries and the prediction does not count that. Set from the H100 (bf16, fused / compile
    # + graph, predicted forward/backward): GoogLeNet b8 1.23x (1.76/1.74), b32 1.15x (1.32/1.35),
    # b64 0.91x (1.20/1.25); Inception-v3 b64 0.87x (1.14/1.17); ResNet-50 b8 0.92x when cut
    # (1.05/1.07). 1.0 cuts every branchy graph. None: the strategy's default
    # (DEFAULT_MIN_PREDICTED_SPEEDUP; "kernels" loses no fusion, so it needs no margin).
    min_predicted_speedup: float | None = None
    # "kernels" with streams > 1: whether inductor may put a new buffer in a dead one's memory.
    # Each reuse orders the new buffer's writer after every reader of the old one, which chains
    # independent branches: an 8-branch net's planned forward goes from ideal 1.24x to 2.25x
    # without reuse, its backward from 1.04x to 3.09x. On the H100 (2026-11-23, each paired with
    # compile + graph in one process) no reuse gave 1.00-1.94x where reuse gave 0.97-1.22x on the
    # same 10 configurations, never slower, at 1.02-1.12x compile + graph's peak memory. It stays
    # on by default until the 50-step GPU training test and the sanitizer have run without it:
    # without reuse more kernels overlap, which is what those tests exist to check.
    buffer_reuse: bool = True

    @property
    def gate(self) -> float:
        if self.min_predicted_speedup is not None:
            return self.min_predicted_speedup
        return DEFAULT_MIN_PREDICTED_SPEEDUP[self.strategy if self.segment_compiler == "inductor" else "segments"]


@dataclass(frozen=True)
class CompiledGraphInfo:
    """What the backend did with one forward or backward graph (kept for inspection and tests)."""

    is_backward: bool
    num_ops: int
    num_segments: int  # segments; for the "kernels" strategy, kernel launches
    num_streams: int
    num_waits: int
    fallback_reason: str | None
    ideal_speedup: float = 1.0
    predicted_speedup: float = 1.0
    strategy: str = "segments"
    num_barriers: int = 0  # "kernels": launches concur could not read, ordered after and before all others


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _roofline(options: BackendOptions, example_inputs: Sequence[Any]) -> Roofline:
    if options.roofline is not None:
        return options.roofline
    device = _device_of(example_inputs)
    return roofline_for(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


@dataclass(frozen=True)
class GraphPlan:
    """The backend's decision for one aten graph: segments on streams, or whole (``segments`` None)."""

    segments: SegmentPlan | None
    ideal_speedup: float = 1.0  # serial / scheduled makespan, each kernel as if alone on the device
    predicted_speedup: float = 1.0  # the same with kernels sharing the device (schedulers.simulate_shared)


DYNAMIC_SHAPES = ("the graph has dynamic (symbolic) shapes; concur schedules static shapes only "
                  "(compile with dynamic=False)")

NCHW_WARNING = ("concur backend: compiling a graph of NCHW convolutions whole, on one stream. Inductor turns "
                "such a graph channels-last as a whole, while segments keep the traced layout where they are "
                "cut (on the H100, fp32 GoogLeNet b32 ran 0.69x of torch.compile when cut). For streams, make "
                "the model and its inputs channels-last: model.to(memory_format=torch.channels_last).")


_CONVOLUTION_INPUT = {torch.ops.aten.convolution.default: 0, torch.ops.aten.convolution_backward.default: 1}


def has_nchw_convolutions(graph: fx.Graph) -> bool:
    """Return True if a 2-d convolution (forward or backward) reads images that are not channels-last."""
    for node in graph.nodes:
        index = _CONVOLUTION_INPUT.get(node.target) if node.op == "call_function" else None
        if index is None:
            continue
        arg = node.args[index]
        x = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] > 1 and x.shape[2] * x.shape[3] > 1 \
                and not x.is_contiguous(memory_format=torch.channels_last):
            return True
    return False


def plan_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions) -> GraphPlan:
    """Schedule an aten graph and return its verified segment plan, or whole if one stream is as good.

    The gate uses the contention-aware prediction: on the H100 the
    contention-free one called ResNet-50's graphs worth cutting, and the cut
    graphs ran 0.92x of torch.compile.

    Raises:
        ValueError: the graph has symbolic shapes, or the plan is invalid (a concur bug).
    """
    if compat.has_symbolic_shapes(list(example_inputs)):
        raise ValueError(DYNAMIC_SHAPES)
    if options.streams > 1 and _device_of(example_inputs).type == "cuda" and compat.inductor_optimizes_layout() \
            and has_nchw_convolutions(gm.graph):
        warnings.warn(NCHW_WARNING, stacklevel=2)
        return GraphPlan(None)
    roof = _roofline(options, example_inputs)
    dag = build_aten_dag(gm.graph, roof)
    if options.streams == 1 or dag.number_of_nodes() < 2:
        return GraphPlan(None)
    # schedule chains and fusion groups, not single pointwise ops (see schedulers.coarsen)
    # a segment must be worth the event that starts it: several kernel launches
    coarse = schedulers.coarsen(dag, min_cost=MIN_SEGMENT_LAUNCHES * roof.kernel_overhead_us)
    schedule = schedulers.expand(dag, coarse, schedulers.schedule(coarse.dag, options.streams,
                                                                  options.scheduler))
    if schedule.num_streams == 1 or schedule.makespan <= 0:
        return GraphPlan(None)
    serial_us = schedulers.serial(dag).makespan
    ideal, predicted = serial_us / schedule.makespan, serial_us / schedulers.simulate_shared(dag, schedule)
    if options.gate > 1.0 and predicted < options.gate:
        return GraphPlan(None, ideal, predicted)
    delay = options.event_delay_launches * roof.kernel_overhead_us
    plan = partition(gm.graph, schedule, node_cost=lambda name: dag.nodes[name]["cost"] if name in dag else 0.0,
                     max_event_delay=delay)
    problems = schedulers.validate(dag, schedule) + verify(plan)
    if problems:
        raise ValueError(f"invalid plan (a concur bug, please report it): {problems[:3]}")
    return GraphPlan(plan, ideal, predicted)


class ConcurBackend:
    """A dynamo backend: ``torch.compile(model, backend=ConcurBackend(BackendOptions(...)))``."""

    def __init__(self, options: BackendOptions = BackendOptions()):
        if options.segment_compiler not in SEGMENT_COMPILERS:
            raise ValueError(f"segment_compiler must be one of {SEGMENT_COMPILERS}, "
                             f"got {options.segment_compiler!r}")
        if isinstance(options.streams, bool) or not isinstance(options.streams, int) or options.streams < 1:
            raise ValueError(f"streams must be a positive int, got {options.streams!r}")
        if options.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {options.strategy!r}")
        if options.scheduler not in schedulers.SCHEDULERS:
            raise ValueError(f"unknown scheduler {options.scheduler!r}; choose one of "
                             f"{sorted(schedulers.SCHEDULERS)}")
        self.options = options
        self.graphs: list[CompiledGraphInfo] = []

    def __repr__(self) -> str:
        o = self.options
        return f"concur.backend(streams={o.streams}, scheduler={o.scheduler!r})"

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        if self.options.segment_compiler == "inductor":
            return compat.inductor_compile_fx(gm, example_inputs, self._compile_with_inductor)
        return compat.aot_autograd_backend(self._compile_eager_forward,
                                           self._compile_eager_backward)(gm, example_inputs)

    # -- per-graph compilation ----------------------------------------------------------------

    def _plan_or_reason(self, gm: fx.GraphModule, example_inputs: Sequence[Any]
                        ) -> tuple[GraphPlan, str | None]:
        try:
            return plan_graph(gm, example_inputs, self.options), None
        except Exception as exc:  # noqa: BLE001 - any failure here means: let inductor run it whole
            return GraphPlan(None), f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"

    def _record(self, gm: fx.GraphModule, decision: GraphPlan, is_backward: bool,
                reason: str | None, num_ops: int | None = None) -> None:
        plan = decision.segments
        if reason is not None:
            warnings.warn(f"concur backend: running a {'backward' if is_backward else 'forward'} graph "
                          f"as plain inductor output on one stream, because {reason}", stacklevel=2)
        self.graphs.append(CompiledGraphInfo(
            is_backward, num_ops if num_ops is not None else sum(1 for n in gm.graph.nodes if n.op == "call_function"),
            len(plan.segments) if plan else 1, plan.num_streams if plan else 1,
            sum(len(s.waits) for s in plan.segments) if plan else 0, reason,
            decision.ideal_speedup, decision.predicted_speedup))

    def _compile_with_inductor(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                               *args: Any, **kwargs: Any) -> Any:
        is_backward = bool(kwargs.get("is_backward", False))
        if self.options.strategy == "kernels":
            return self._compile_then_place(gm, example_inputs, is_backward, args, kwargs)
        decision, reason = self._plan_or_reason(gm, example_inputs)
        plan = decision.segments
        if plan is None:
            self._record(gm, decision, is_backward, reason)
            return compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
        # example value of every node a segment may read: graph inputs as given, others as traced
        examples = {n.name: n.meta.get("val") for n in gm.graph.nodes}
        examples.update(zip(plan.placeholders, example_inputs))
        static = {plan.placeholders[i] for i in kwargs.get("static_input_idxs", ())}
        try:
            with compat.deferred_kernel_compiles():  # the kernels of all segments compile side by side
                compiled = [self._inductor_segment(gm, segment, examples, static, args, kwargs)
                            for segment in plan.segments]
        except Exception as exc:  # noqa: BLE001 - a segment inductor rejects: compile the graph whole
            self._record(gm, GraphPlan(None), is_backward, f"inductor rejected a segment ({type(exc).__name__}: "
                                               f"{str(exc).splitlines()[0][:300]})")
            return compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
        self._record(gm, decision, is_backward, None)
        return SegmentedCall(gm, plan, compiled)

    def _compile_then_place(self, gm: fx.GraphModule, example_inputs: Sequence[Any], is_backward: bool,
                            args: tuple, kwargs: dict) -> Any:
        """Compile the graph whole with inductor, then put its kernel launches on streams."""
        o = self.options
        if compat.has_symbolic_shapes(list(example_inputs)):
            compiled = compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
            self._record(gm, GraphPlan(None), is_backward, DYNAMIC_SHAPES)
            return compiled
        roof = _roofline(o, example_inputs)
        node_costs = {}
        if o.streams > 1:  # costs come from the fx graph, which inductor's post-grad passes rewrite in place
            dag = build_aten_dag(gm.graph, roof)
            node_costs = {v: (dag.nodes[v]["cost"], dag.nodes[v]["share"]) for v in dag}
        num_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        # without reuse only where streams follow; otherwise inductor's (and the user's) setting stands
        fresh_buffers = not o.buffer_reuse and o.streams > 1
        with compat.inductor_buffer_reuse(False) if fresh_buffers else contextlib.nullcontext():
            compiled = compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
        if o.streams == 1:
            self._record(gm, GraphPlan(None), is_backward, None, num_ops)
            return compiled
        try:
            placed = place_kernels(compiled, node_costs, roof, o.streams, o.scheduler, o.gate)
        except Exception as exc:  # noqa: BLE001 - any failure here means: run inductor's output as it is
            self._record(gm, GraphPlan(None), is_backward, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                         num_ops)
            return compiled
        plan = placed.plan
        self.graphs.append(CompiledGraphInfo(is_backward, num_ops, plan.num_launches,
                                             plan.num_streams if placed.installed else 1,
                                             plan.num_waits if placed.installed else 0, None,
                                             plan.ideal_speedup, plan.predicted_speedup, "kernels",
                                             plan.num_barriers))
        return compiled

    def _inductor_segment(self, gm: fx.GraphModule, segment: Segment, examples: dict[str, Any],
                          static: set[str], args: tuple, kwargs: dict) -> Callable:
        seg_kwargs = dict(kwargs, static_input_idxs=[i for i, u in enumerate(segment.inputs) if u in static])
        with compat.private_output_strides():
            return compat.inductor_compile_graph(segment_module(gm, segment), [examples[u] for u in segment.inputs],
                                                 *args, **seg_kwargs)

    def _compile_eager(self, gm: fx.GraphModule, example_inputs: Sequence[Any], is_backward: bool) -> Any:
        decision, reason = self._plan_or_reason(gm, example_inputs)
        self._record(gm, decision, is_backward, reason)
        plan = decision.segments
        if plan is None:
            return _boxed(gm)
        return SegmentedCall(gm, plan, [_boxed(segment_module(gm, s)) for s in plan.segments])

    def _compile_eager_forward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return self._compile_eager(gm, example_inputs, is_backward=False)

    def _compile_eager_backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return self._compile_eager(gm, example_inputs, is_backward=True)


def _boxed(gm: fx.GraphModule) -> Callable[[list], Any]:
    def run(args: list) -> Any:
        values = list(args)
        args.clear()
        return gm(*values)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def backend(streams: int = 4, scheduler: str = "critical_path", *,
            segment_compiler: str = "inductor", roofline: Roofline | None = None,
            event_delay_launches: float = 0.0, min_predicted_speedup: float | None = None,
            strategy: str = "kernels", buffer_reuse: bool = True) -> ConcurBackend:
    """Return a ``torch.compile`` backend putting inductor's fused kernels on up to ``streams`` streams.

    ``torch.compile(model, backend=concur.backend(streams=4))``; the name
    ``"concur"`` is the same with defaults.

    ``strategy="kernels"`` (default) lets inductor compile each graph whole
    and then issues its kernel launches on streams (:mod:`concur.kernel_streams`):
    fusion and layout are exactly ``torch.compile``'s. ``strategy="segments"``
    cuts each graph per stream and compiles the pieces (:mod:`concur.segments`);
    ``event_delay_launches`` (experimental, default off) trades some
    concurrency for fewer segments there. ``segment_compiler="eager"`` skips
    inductor and runs segments as fx code (for tests and debugging).

    A graph whose schedule predicts less than ``min_predicted_speedup`` over
    one stream (kernels sharing the device) runs on one stream, exactly as
    ``torch.compile`` would; None takes the strategy's default
    (:data:`DEFAULT_MIN_PREDICTED_SPEEDUP`). With segments, so does a CUDA
    graph of NCHW convolutions.

    ``buffer_reuse=False`` (kernels strategy with several streams; measured
    faster, not yet the default) stops inductor from placing new buffers in
    dead ones, whose reuse chains independent branches: a little more memory,
    much more concurrency (README, "Streams on top of fusion").
    """
    if event_delay_launches < 0:
        raise ValueError(f"event_delay_launches must be >= 0, got {event_delay_launches!r}")
    if min_predicted_speedup is not None and min_predicted_speedup < 1.0:
        raise ValueError(f"min_predicted_speedup must be >= 1.0, got {min_predicted_speedup!r}")
    return ConcurBackend(BackendOptions(streams, scheduler, segment_compiler, strategy, roofline,
                                        event_delay_launches, min_predicted_speedup, buffer_reuse))


def concur_backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
    """The default backend, registered as ``"concur"`` (also via the ``torch_dynamo_backends`` entry point)."""
    return backend()(gm, example_inputs)

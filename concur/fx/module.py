"""The public entry points: ``optimize`` (a drop-in concurrent module) and ``inspect``."""

from __future__ import annotations

import inspect as pyinspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

import schedulers

from concur import _torch_compat as compat
from concur.caller_memory import available as caller_memory_available
from concur.dag import decide
from concur.dag.cost import AnalyticCost, CostModel, describe, roofline_for
from concur.dag.calibration import calibration_for
from concur.dag.disk_cache import JsonCache
from concur.dag.measure import can_time
from concur.dag.memory_budget import plan_budget
from concur.errors import CaptureError, ConcurError, ExampleInputError, debug
from concur.fx.trace import AUTO_LEAVES_META, LeafSpec
from concur.fx.plan_timing import PendingChoice, decision_key, plan_timer
from concur.fx.plan import Plan, analyse, cuda_device, device_name, generate_plan, split_prologue

__all__ = ["ConcurModule", "optimize", "Inspection", "inspect"]

FALLBACKS = ("error", "eager")
# what a plan's memory budget covers: the forward program's streams, or a training step's backward too
MEMORY_MODELS = ("forward", "training")
# measure=DEFERRED: where a new decision is to be timed, the caller times it (train_step's first steps), see
# ConcurModule.pending_choice
DEFERRED = "deferred"


# What a ConcurModule derives and rebuilds after a copy instead of copying it: the original model's own
# dicts it shares (compat.share_module_state), a compiled call bound to it, and its plans.
_DERIVED = frozenset(compat.MODULE_SHARED_STATE) | {compat.MODULE_COMPILED_CALL, "original", "_options", "_plans",
                                                    "_plan_attrs", "_pending"}


class ConcurModule(compat.StateDictOfOriginal, nn.Module):
    """A model whose forward runs a concurrent plan; everything else is the original model.

    It shares the original model's submodule, parameter and buffer
    dictionaries (the same dict objects), so parameters are the same
    ``Parameter`` objects (an optimizer built on the original keeps working),
    ``state_dict`` keys are unchanged, and ``.to()``, ``.train()`` and
    ``load_state_dict`` act on one set of tensors seen by both. Its
    ``training`` flag *is* the original's, and ``train()``/``eval()`` run the
    original's own (possibly overridden) ``train``, so a mode set on either
    object is the mode of both. Attributes it lacks are read from the original.

    fx bakes Python-level branches on ``self.training`` into the trace (e.g.
    GoogLeNet's auxiliary heads), so one plan is kept per combination of the
    modules' training flags, built the first time that combination runs.

    A copy (``copy.deepcopy``, pickling, ``torch.save``, ``AveragedModel``) is
    a copy of the original model plus the options; its plans are rebuilt on
    its first call, from that call's inputs, as for a mode not run before.
    The plans themselves are not copied: they hold CUDA streams and events,
    and code bound to the objects they were traced from.
    """

    def __init__(self, model: nn.Module, example_inputs: tuple, streams: int, scheduler: str,
                 cost_model: CostModel | None, leaf_modules: LeafSpec, split_weight_grads: bool = False,
                 measure: bool | str = True, memory_model: str = "forward", lean_pools: bool = False,
                 caller_memory: bool = False):
        super().__init__()
        self._attach(model, dict(streams=streams, scheduler=scheduler, cost_model=cost_model,
                                 leaf_modules=leaf_modules if isinstance(leaf_modules, str)
                                 else tuple(leaf_modules), split_weight_grads=split_weight_grads,
                                 measure=measure, memory_model=memory_model, lean_pools=lean_pools,
                                 caller_memory=caller_memory))
        self._plan_for(example_inputs)

    def _attach(self, model: nn.Module, options: dict) -> None:
        compat.share_module_state(self, model)
        object.__setattr__(self, "original", model)
        self._options = options
        self._plans: dict[tuple[bool, ...], Plan] = {}
        self._plan_attrs: set[str] = set()  # attributes a plan put on self: not the user's, not copied
        self._pending: dict[tuple[bool, ...], PendingChoice] = {}  # measure=DEFERRED: decisions left to time

    @property
    def training(self) -> bool:  # type: ignore[override]
        """The original model's flag: there is only one."""
        original = self.__dict__.get("original")
        return True if original is None else original.training

    @training.setter
    def training(self, mode: bool) -> None:
        original = self.__dict__.get("original")
        if original is not None:  # nn.Module.__init__ sets it before there is an original
            original.training = mode

    def train(self, mode: bool = True) -> "ConcurModule":
        """Set the original model's mode with its own ``train`` (which a model may override); return self."""
        self.original.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None or name.startswith("__"):  # mid-unpickling, or a protocol probe
                raise
            return getattr(original, name)

    def __reduce__(self):
        state = {k: v for k, v in self.__dict__.items()
                 if k not in _DERIVED and k not in self._plan_attrs}
        return _rebuild, (self.original, self._options), state

    def _decided_plan(self, inputs: tuple) -> Plan:
        """Trace once, schedule, and keep a multi-stream plan or one stream (:func:`concur.dag.decide.choose`).

        With ``streams="auto"`` the candidates are the schedules on 2, 3 and
        4 streams (those that coincide count once). On CUDA they are timed
        against the one-stream plan, all generated from the one trace,
        forward and backward, in CUDA graphs (:mod:`concur.fx.plan_timing`);
        elsewhere the prediction decides.
        """
        o = self._options
        traced, dag = analyse(self.original, inputs, o["cost_model"], o["leaf_modules"])
        self._adopt_constants(traced)
        prologue, scheduled = split_prologue(dag)
        budget = plan_budget(scheduled, cuda_device(self.original, inputs))
        schedules = decide.distinct_schedules(scheduled, decide.stream_counts(o["streams"]), o["scheduler"],
                                              memory_budget=budget,
                                              training_memory=o.get("memory_model") == "training")
        candidates = [s for s in schedules if s.num_streams > 1]
        # a copy made before lean_pools or caller_memory has none
        rewrites = (o["split_weight_grads"], o.get("lean_pools", False), o.get("caller_memory", False))
        if not candidates:
            return generate_plan(self.original, traced, dag, prologue, schedules[0], *rewrites)
        plans = [generate_plan(self.original, traced, dag, prologue, s, *rewrites) for s in candidates]
        predictions = [decide.predict(scheduled, s) for s in candidates]
        made: list[Plan] = []

        def one_stream() -> Plan:  # from the same trace, made only where it is timed or kept
            if not made:
                made.append(generate_plan(self.original, traced, dag, prologue,
                                          decide.schedule_graph(scheduled, 1, o["scheduler"])))
            return made[0]

        timer, key = None, None
        device = cuda_device(self.original, inputs)
        what = f"concur.optimize of {type(self.original).__name__}"
        measure = o.get("measure", True)
        if measure == DEFERRED:
            # the caller, which can time (it says so), times the plans in its own first steps where nothing
            # is cached for them
            timed = decide.timed_candidates(predictions)
            if timed:
                key = decision_key(self.original, traced, inputs, plans, device or torch.device("cpu"), "train_step")
                cached = decide.cached_choice(what, predictions, JsonCache(), key)
                if cached is not None:
                    return plans[cached.candidate] if cached.keep else one_stream()
                default = timed[decide.by_prediction([predictions[i] for i in timed])]
                self._pending[self._mode_key()] = PendingChoice(what, predictions, plans, timed, one_stream(), key,
                                                                default)
                return plans[default]
        elif measure and can_time(device):
            timed = [plans[i] for i in decide.timed_candidates(predictions)]
            timer = plan_timer(self, one_stream, timed, inputs, device)
            key = decision_key(self.original, traced, inputs, plans, device)
        decision = decide.choose(what, predictions, timer=timer,
                                 cache=JsonCache() if timer is not None else None, key=key)
        return plans[decision.candidate] if decision.keep else one_stream()

    def _adopt_constants(self, traced: fx.GraphModule) -> None:
        """Put the trace's fx-made constants on self, where the generated code reads them."""
        for node in traced.graph.nodes:
            if node.op == "get_attr":
                atom = str(node.target).split(".")[0]
                if atom not in self.__dict__ and not hasattr(self.original, atom):
                    object.__setattr__(self, atom, getattr(traced, atom))
                    self._plan_attrs.add(atom)

    def _mode_key(self) -> tuple[bool, ...]:
        return tuple(m.training for m in self.modules())

    def _plan_for(self, inputs: tuple) -> Plan:
        key = self._mode_key()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._decided_plan(inputs)
            self._plan_attrs.add(plan.runtime_attr)
            self._plans[key] = plan
        return plan

    def pending_choice(self) -> PendingChoice | None:
        """The current mode's decision left to the caller to time (``measure=DEFERRED``), or None."""
        return self._pending.get(self._mode_key())

    def run_plan(self, plan: Plan) -> None:
        """Run ``plan`` in the current mode from now on: one of its pending choice's programs, while timing them."""
        self._plan_attrs.add(plan.runtime_attr)
        self._plans[self._mode_key()] = plan

    def time_predicted_alone(self, why: str, cached: bool) -> None:
        """Narrow the current mode's pending choice to one stream against the predicted plan
        (:meth:`PendingChoice.predicted_alone`, ``why``, ``cached``), and run the predicted plan: the caller
        times it, then the one-stream plan, one at a time."""
        key = self._mode_key()
        self._pending[key] = choice = self._pending[key].predicted_alone(why, cached)
        self.run_plan(choice.plans[0])

    def settle(self, rounds: Sequence[tuple[float, ...]] | None, why: str = "") -> decide.Decision:
        """Decide the current mode's pending choice on the caller's timed ``rounds``, or by prediction where
        there are none (the caller could not time them: ``why``); run the plan it picks."""
        choice = self._pending.pop(self._mode_key())
        decision, plan = choice.settle(rounds, why)
        self.run_plan(plan)
        return decision

    @property
    def plan(self) -> Plan:
        """The plan of the current train/eval mode (built on first use of that mode)."""
        key = self._mode_key()
        if key not in self._plans:
            raise RuntimeError("no plan for this train/eval mode yet (a copy has none before its first "
                               "call): call the module once first")
        return self._plans[key]

    @property
    def auto_leaves(self) -> tuple[str, ...]:
        """Paths of the submodules ``leaf_modules="auto"`` kept whole (current mode's plan)."""
        return self.plan.traced.meta.get(AUTO_LEAVES_META, ())

    @property
    def schedule(self) -> schedulers.Schedule:
        """The schedule of the current mode: stream per node, issue order, waits."""
        return self.plan.schedule

    def forward(self, *inputs: Any) -> Any:
        try:
            plan, rejected = self._plan_for(inputs), None
        except ExampleInputError as exc:  # a new mode's plan, built on inputs the model rejects
            plan, rejected = None, exc.original
        if rejected is not None:
            raise rejected  # the error the model itself gives on them, not one about setup
        object.__setattr__(self, plan.runtime_attr, plan.runtime)
        try:
            return plan.forward(self, *inputs)
        except BaseException:
            plan.runtime.abort()
            raise


def _rebuild(model: nn.Module, options: dict) -> ConcurModule:
    """Return a ConcurModule over ``model`` with no plan yet (unpickling and deep copies call this)."""
    cm = ConcurModule.__new__(ConcurModule)
    nn.Module.__init__(cm)
    cm._attach(model, options)
    return cm


def _check_inputs(model: Any, example_inputs: Any, streams: Any) -> tuple:
    if not isinstance(model, nn.Module):
        raise TypeError(f"concur.optimize expects an nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, "
                        f"e.g. (torch.randn(8, 3, 224, 224),); got {type(example_inputs).__name__}")
    if streams != decide.AUTO and (isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= 64):
        raise ValueError(f"streams must be an int from 1 to 64 or 'auto', got {streams!r}")
    example_inputs = tuple(example_inputs)
    try:
        signature = pyinspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward Python cannot introspect: the run will tell
        return example_inputs
    try:
        signature.bind(*example_inputs)
    except TypeError as exc:
        raise ExampleInputError(
            f"concur: example_inputs holds {len(example_inputs)} input(s) for "
            f"{type(model).__name__}.forward{signature}: {exc}. Fix: pass a tuple with one example per "
            f"positional argument of forward", "example_inputs") from None
    return example_inputs


def optimize(model: nn.Module, example_inputs: tuple, streams: int | str = 4,
             scheduler: str = "critical_path", *, cost_model: CostModel | None = None,
             leaf_modules: LeafSpec = (), fallback: str = "error", split_weight_grads: bool = False,
             measure: bool | str = True, memory_model: str = "forward", lean_pools: bool = False,
             caller_memory: bool = False) -> nn.Module:
    """Return a drop-in module running ``model``'s independent operations on ``streams`` streams.

    Outputs, gradients and buffer updates equal the original model's. On CPU
    the same plan runs in its issue order. ``leaf_modules`` names submodules
    (types or paths) to keep whole as one opaque operation; ``"auto"`` makes
    leaves of the submodules fx cannot trace, warns naming them, and lists them
    in ``auto_leaves``. ``fallback="eager"`` returns ``model`` itself, with a
    warning, when it cannot be traced.

    Never slower than one stream: a plan whose contention-aware predicted
    speedup is below 1.0 is replaced by one stream, generated from the same
    trace. On CUDA, with ``measure=True`` (the default), a plan predicted
    faster is then timed against the one-stream plan, forward and backward,
    each captured in a CUDA graph, in alternating replays, and kept only if
    its median is more than 1% faster; the answer is cached on disk per
    graph, shapes, dtypes, GPU and torch (:mod:`concur.dag.decide`). One
    info line on the ``concur`` logger gives each decision and its times.
    ``measure="deferred"`` leaves a decision not cached yet to the caller,
    which times the plans itself (:func:`concur.train_step` on its first
    calls, through ``ConcurModule.pending_choice``); until then the module
    runs the plan the prediction picks.

    ``streams="auto"`` weighs the plans on 2, 3 and 4 streams, all from one
    trace, against one stream in the same way: timed together on CUDA (the
    fewest streams within 1% of the fastest, kept only if more than 1%
    faster than one stream), else the fewest streams predicted within 3% of
    the best.

    ``split_weight_grads=True`` runs the weight (and bias) gradients of plain
    ``nn.Conv2d`` and ``nn.Linear`` layers on one more, low-priority stream in
    backward, off the critical path, through autograd itself
    (:mod:`concur.fx.weight_grads`); a plan's ``weight_grad_splits`` counts
    them. One-stream plans never split. It is for steps replayed from a CUDA
    graph, as :func:`concur.train_step` does (there it is the default): each
    split layer records three autograd nodes instead of one, about 0.1 ms
    more host time per layer and step (GoogLeNet, 58 layers: +10 ms per
    forward and backward on a CPU), which only a graph replay does not pay.

    A plan keeps its memory within a budget: 1.05 times the one-stream
    program's peak, and never more than the device has free
    (:mod:`concur.dag.memory_budget`). ``memory_model="forward"`` (the
    default) counts the forward program's streams: a block a stream freed
    serves only that stream again. ``"training"`` also counts what a training
    step's backward needs: an activation saved on a side stream is freed into
    that stream's blocks, which the backward's allocations on the caller's
    stream cannot reuse, so side streams get only the branches whose saved
    activations fit: a plan for a training loop short of memory
    (:func:`concur.train_step` keeps the default).

    ``lean_pools=True`` has the max-pooling layers of a plan of more than
    one stream save no indices (int64, the size of their output) for
    backward, which recomputes them from the saved input
    (:mod:`concur.fx.pool_indices`): the same outputs and gradients, bit for
    bit, for one more pooling kernel in backward; a plan's
    ``pool_recomputes`` counts them. :func:`concur.train_step` plans its
    fallback on fewer streams so where the streams asked for do not fit.

    ``caller_memory=True`` launches the side streams' ops of a plan of more
    than one stream from below autograd, torch's current stream the
    caller's, their large outputs made on the caller's stream: every
    activation is the caller's stream's memory and the whole backward runs
    there (:mod:`concur.caller_memory`). The same outputs and gradients; a
    training step short of memory keeps its streams so, where the plain
    program's side streams do not fit (:func:`concur.train_step` takes it
    then, by default: ``concur.training.rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY``;
    unlimited, the plain program is faster). Where this torch has no
    dispatch modes it is off.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if measure not in (True, False, DEFERRED):
        raise ValueError(f"measure must be True, False or {DEFERRED!r}, got {measure!r}")
    if memory_model not in MEMORY_MODELS:
        raise ValueError(f"memory_model must be one of {MEMORY_MODELS}, got {memory_model!r}")
    example_inputs = _check_inputs(model, example_inputs, streams)
    if scheduler not in schedulers.SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {sorted(schedulers.SCHEDULERS)}")
    try:
        return ConcurModule(model, example_inputs, streams, scheduler, cost_model, leaf_modules, split_weight_grads,
                            measure, memory_model, lean_pools, caller_memory and caller_memory_available())
    except CaptureError as exc:
        if fallback == "eager":
            warnings.warn(f"{exc}\nconcur falls back to running the model unchanged (fallback='eager').",
                          stacklevel=2)
            return model
        raise _from_here(exc)
    except ExampleInputError as exc:
        raise _from_here(exc)


def _from_here(exc: ConcurError) -> ConcurError:
    """Return ``exc`` with its traceback cut to the public call, unless ``CONCUR_DEBUG`` asks for it all.

    The user's mistake (an input, a model line) is in the message; the frames of
    concur's setup between the call and the raise would only bury it.
    """
    return exc if debug() else exc.with_traceback(None)


@dataclass(frozen=True)
class Inspection:
    """What concur sees in a model: size of the DAG, its width, and predicted speedups."""

    model: str
    num_ops: int
    num_kernels: int
    width: int
    serial_us: float
    critical_path_us: float
    predicted_speedup: dict[int, float] = field(default_factory=dict)  # concurrent kernels share the device
    auto_leaves: tuple[str, ...] = ()
    ideal_speedup: dict[int, float] = field(default_factory=dict)  # each kernel as fast as alone: a bound
    device_model: str = ""  # the device the op costs are predicted for (cost.describe)
    # the prediction fitted to measured decisions on a GPU of this kind (concur.dag.calibration); {} where none is
    calibrated_speedup: dict[int, float] = field(default_factory=dict)
    calibrated_on: str | None = None  # the GPU those measurements were taken on

    def __str__(self) -> str:
        rows = [f"model              {self.model}",
                f"device model       {self.device_model}",
                f"operations         {self.num_ops} ({self.num_kernels} launch kernels)",
                f"DAG width          {self.width} (most ops in one topological generation)",
                f"serial time        {self.serial_us:,.1f} us (predicted, sum of op costs)",
                f"critical path      {self.critical_path_us:,.1f} us "
                f"(bound: {self.serial_us / max(self.critical_path_us, 1e-9):.2f}x)",
                "streams  predicted speedup  (if kernels did not compete for the device)"]
        rows += [f"{k:>7}  {v:17.2f}x  ({self.ideal_speedup.get(k, float('nan')):.2f}x)"
                 for k, v in self.predicted_speedup.items()]
        if self.calibrated_speedup:
            rows.append(f"calibrated         " + ", ".join(f"{k}: {v:.2f}x" for k, v in self.calibrated_speedup.items())
                        + f" (fitted to measurements on an {self.calibrated_on})")
        if self.auto_leaves:
            shown = ", ".join(self.auto_leaves[:4]) + (", ..." if len(self.auto_leaves) > 4 else "")
            rows.append(f"auto leaves        {len(self.auto_leaves)} kept whole, fx cannot trace them: {shown}")
        return "\n".join(rows)


def inspect(model: nn.Module, example_inputs: tuple, *, scheduler: str = "critical_path",
            max_streams: int = 8, cost_model: CostModel | None = None,
            leaf_modules: LeafSpec = (), device: str | None = None) -> Inspection:
    """Return the op count, DAG width, critical path and predicted speedup for 1..max_streams.

    Op times are predicted by ``cost_model``, else by the roofline of ``device`` (a key of
    ``concur.dag.cost.ROOFLINES`` such as ``"h100"``, or a CUDA device name), else by that of the
    device the example inputs are on; ``device_model`` in the result names it.
    """
    example_inputs = _check_inputs(model, example_inputs, 1)
    if cost_model is None:
        cost_model = AnalyticCost(roofline_for(device or device_name(model, example_inputs)))
    try:
        traced, dag = analyse(model, example_inputs, cost_model, leaf_modules)
    except (CaptureError, ExampleInputError) as exc:
        raise _from_here(exc)
    speedups = schedulers.speedup_predictions(dag, max_streams, scheduler)
    fitted = calibration_for(cost_model.roofline.name if isinstance(cost_model, AnalyticCost)
                             else device or device_name(model, example_inputs))
    return Inspection(
        model=type(model).__name__,
        num_ops=dag.number_of_nodes(),
        num_kernels=sum(1 for _, d in dag.nodes(data=True) if d["facts"].launches_kernel),
        width=schedulers.width(dag),
        serial_us=sum(d["cost"] for _, d in dag.nodes(data=True)),
        critical_path_us=schedulers.critical_path_length(dag),
        predicted_speedup=speedups["contention"],
        auto_leaves=traced.meta.get(AUTO_LEAVES_META, ()),
        ideal_speedup=speedups["ideal"],
        device_model=describe(cost_model),
        calibrated_speedup={k: fitted.speedup(v, speedups["ideal"][k]) for k, v in speedups["contention"].items()}
        if fitted else {},
        calibrated_on=fitted.gpu if fitted else None,
    )

"""Build a concurrent plan: trace → annotate → DAG → costs → schedule → generated code (weight gradients
split off), all checked; one trace serves every plan of it (:func:`generate_plan`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import networkx as nx
import torch
import torch.fx as fx

import schedulers
from schedulers import Schedule

from concur.dag import decide
from concur.dag.annotate import OpFailed, annotate, cuda_device_in, preserved_state, tensors_in
from concur.dag.cost import AnalyticCost, CostModel, assign_costs, roofline_for
from concur.dag.hazards import build_dag, is_free_source
from concur.dag.memory_budget import plan_budget
from concur.errors import TRACEBACK_HINT, CaptureError, ConcurError, ExampleInputError, PlanError, debug
from concur.fx.trace import LeafSpec, trace
from concur.fx.codegen import event_count, generate
from concur.fx.verify import verify_generated
from concur.fx.pool_indices import recompute_pool_indices
from concur.fx.weight_grads import split_weight_gradients
from concur.streams import StreamRuntime

_plan_ids = itertools.count()


@dataclass(frozen=True)
class Plan:
    """One model, traced in one train/eval mode, scheduled on streams, as runnable code."""

    schedule: Schedule
    dag: nx.DiGraph
    generated: fx.GraphModule
    runtime: StreamRuntime
    runtime_attr: str
    traced: fx.GraphModule
    weight_grad_splits: int = 0  # layers whose weight gradient runs on the weight-gradient stream
    pool_recomputes: int = 0  # max-pooling calls that save no indices, recomputed in backward

    @property
    def forward(self) -> Callable:
        """The generated forward as a plain function taking the owning module as ``self``."""
        return type(self.generated).forward

    @property
    def code(self) -> str:
        """The Python source of the generated forward."""
        return self.generated.code


def cuda_device(model: torch.nn.Module, inputs: tuple) -> torch.device | None:
    """Return the CUDA device the inputs or the model (its first parameter) are on, or None."""
    return cuda_device_in(inputs, list(itertools.islice(model.parameters(), 1)))


def device_name(model: torch.nn.Module, example_inputs: tuple) -> str:
    """Return the name of the device the model runs on ('cpu' or the CUDA device's name)."""
    cuda = cuda_device(model, example_inputs)
    return torch.cuda.get_device_name(cuda) if cuda is not None else "cpu"


def analyse(model: torch.nn.Module, example_inputs: tuple, cost_model: CostModel | None = None,
            leaf_modules: LeafSpec = ()) -> tuple[fx.GraphModule, nx.DiGraph]:
    """Return the traced GraphModule and its costed dependency DAG."""
    traced = trace(model, leaf_modules)
    # a training step's forward: which outputs autograd saves for backward (memory-aware plans)
    saved = model.training and torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    try:
        annotate(traced, example_inputs, saved=saved)
        failure = None
    except OpFailed as exc:
        failure = exc
    if failure is not None and saved:  # recording autograd's graph is what failed: annotate as without it
        try:
            annotate(traced, example_inputs)
            failure = None
        except OpFailed as exc:
            failure = exc
    if failure is not None:  # raised outside the handler, so the chain is what is set here
        error = explain_failure(model, example_inputs, failure)
        if error is failure.cause:
            raise error  # torch's own error, unchanged
        error.__context__ = failure.cause  # kept for who looks for it, not printed (CONCUR_DEBUG prints it)
        raise error from (failure.cause if debug() else None)
    dag = build_dag(traced.graph)
    assign_costs(dag, cost_model or AnalyticCost(roofline_for(device_name(model, example_inputs))))
    return traced, dag


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def _op_name(model: torch.nn.Module, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"`{node.target}` ({type(model.get_submodule(str(node.target))).__name__})"
    name = getattr(node.target, "__name__", str(node.target))
    return f"`{name}` (graph node {node.name})"


def _mismatch(model: torch.nn.Module, example_inputs: tuple) -> str | None:
    """Return what is wrong with the first input on another device or of another dtype than the model."""
    state = [*model.parameters(), *model.buffers()]
    devices = {t.device for t in state}
    dtypes = {t.dtype for t in state if t.is_floating_point()}
    for i, value in enumerate(example_inputs):
        for t in tensors_in(value):
            if len(devices) == 1 and t.device not in devices:
                (device,) = devices
                return (f"example_inputs[{i}] is on {t.device} but the model's parameters are on {device}. "
                        f"Fix: move the example to the model's device, `x.to('{device}')` (or the model to "
                        f"the example's, `model.to('{t.device}')`, before concur.optimize)")
            if len(dtypes) == 1 and t.is_floating_point() and t.dtype not in dtypes:
                (dtype,) = dtypes
                return (f"example_inputs[{i}] is {t.dtype} but the model's parameters are {dtype}. "
                        f"Fix: pass `x.to({dtype})` (or convert the model first, `model.to({t.dtype})`)")
    return None


def _model_runs(model: torch.nn.Module, example_inputs: tuple) -> bool:
    """Return True if the model itself runs on (clones of) the inputs; its state is left as it was."""
    inputs = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs)
    devices = {t.device for t in tensors_in(inputs)} | {p.device for p in model.parameters()}
    try:
        with preserved_state(model, devices), torch.no_grad():
            model(*inputs)
    except Exception:
        return False
    return True


def explain_failure(model: torch.nn.Module, example_inputs: tuple, failure: OpFailed) -> BaseException:
    """Return the exception to raise for an op that failed on the example inputs at setup.

    The model is run eagerly on the same inputs to tell whose fault it is: if
    it raises too, the inputs are wrong (:class:`ExampleInputError`, naming
    the input and the fix); if it runs, the trace fixed something these
    inputs contradict (:class:`CaptureError`). Running out of memory is
    neither: torch's own error is returned unchanged.
    """
    cause = failure.cause
    if isinstance(cause, (torch.OutOfMemoryError, MemoryError)):
        return cause
    where = _op_name(model, failure.node)
    first_line = (str(cause).strip().splitlines() or [""])[0][:300]
    torch_says = f"torch raised in {where}: {type(cause).__name__}: {first_line}"
    shapes = ", ".join(_describe(t) for t in tensors_in(example_inputs)) or "no tensors"
    if _model_runs(model, example_inputs):
        message = (f"concur traced {type(model).__name__}, but the traced graph fails on example_inputs "
                   f"({shapes}) where the model itself runs: {torch_says}. fx fixed a Python value at "
                   f"trace time (a shape, a flag) that these inputs contradict. Fix: keep the module with "
                   f"that code whole with leaf_modules=[...], or pass fallback='eager' to run the model "
                   f"unchanged. {TRACEBACK_HINT}")
        path = str(failure.node.target) if failure.node.op == "call_module" else ""
        error: ConcurError = CaptureError(message, path, type(model.get_submodule(path)).__name__, None)
    else:
        mismatch = _mismatch(model, example_inputs)
        argument = mismatch.split(" ", 1)[0] if mismatch else "example_inputs"
        fix = mismatch or (f"the model fails on example_inputs ({shapes}). Fix: pass example inputs "
                           f"that `model(*example_inputs)` accepts: concur runs the model once on them "
                           f"to see what each operation reads and writes")
        error = ExampleInputError(f"concur: {fix}.\n{torch_says} {TRACEBACK_HINT}", argument, cause)
    error.original = cause
    return error


def hoistable(dag: nx.DiGraph) -> frozenset[str]:
    """Return the ops that launch no kernel and depend on nothing (e.g. views of buffers).

    They do no GPU work, so they can run before the fork, on the caller's
    stream, and nobody needs to wait for them; left to the scheduler they could
    land on a side stream and cost a pointless event wait.
    """
    return frozenset(n for n in dag if is_free_source(dag, n))


def split_prologue(dag: nx.DiGraph) -> tuple[frozenset[str], nx.DiGraph]:
    """Return (the prologue, the DAG without it): the prologue (:func:`hoistable`) runs before the fork, unscheduled."""
    prologue = hoistable(dag)
    return prologue, dag.subgraph(n for n in dag if n not in prologue).copy()


def schedule_ops(dag: nx.DiGraph, streams: int, scheduler: str, device: torch.device | None = None
                 ) -> tuple[frozenset[str], nx.DiGraph, Schedule]:
    """Return (the prologue, the DAG without it, its schedule on up to ``streams`` streams).

    Ops are scheduled one by one (:func:`concur.dag.decide.schedule_graph`), within the memory budget of
    :func:`concur.dag.memory_budget.plan_budget` (``device``: what is free there).
    """
    prologue, scheduled = split_prologue(dag)
    return prologue, scheduled, decide.schedule_graph(scheduled, streams, scheduler,
                                                      memory_budget=plan_budget(scheduled, device))


# Whether a one-stream plan splits its weight gradients too: its forward the model's own serial program, its
# weight gradients on the weight-gradient stream in backward. Off: under memory pressure, where the fallback
# to one stream runs, that stream's cuDNN workspaces are allocated beside the caller's and need not fit (cuDNN
# then keeps a slower algorithm for the process: Inception-v3 b64 under 1.05x ran 0.97x the recipe, its stem
# split then); `experiments/memory.py --serial-weight-grads` weighs it
SERIAL_WEIGHT_GRADS = False


def generate_plan(model: torch.nn.Module, traced: fx.GraphModule, dag: nx.DiGraph, prologue: frozenset[str],
                  schedule: Schedule, split_weight_grads: bool = False, lean_pools: bool = False,
                  caller_memory: bool = False) -> Plan:
    """Return the verified plan running ``traced`` (analysed as ``dag``) in ``schedule``.

    A plan of more than one stream splits its weight gradients with
    ``split_weight_grads`` (:mod:`concur.fx.weight_grads`) and, with
    ``lean_pools``, recomputes its max-pooling indices in backward instead of
    saving them (:mod:`concur.fx.pool_indices`); a one-stream plan stays the
    model's own program, unless :data:`SERIAL_WEIGHT_GRADS` splits its
    weight gradients too (off: measured not to fit where the streams do not).
    With ``caller_memory`` a plan of more than one stream launches its side
    streams' ops from below autograd, their large outputs made on the
    caller's stream, and runs its whole backward there
    (:mod:`concur.caller_memory`).

    ``traced`` is not changed, so one trace gives several plans (the
    multi-stream one, and one stream to fall back to or to time against).

    Raises:
        PlanError: the schedule or the generated code violates a dependency (a concur bug).
    """
    scheduled = dag.subgraph(n for n in dag if n not in prologue)
    problems = schedulers.validate(scheduled, schedule)
    runtime_attr = f"_concur_runtime_{next(_plan_ids)}"
    graph = generate(traced.graph, schedule, runtime_attr, prologue)
    splits = split_weight_gradients(graph, model, runtime_attr) \
        if split_weight_grads and (schedule.num_streams > 1 or SERIAL_WEIGHT_GRADS) else 0
    pools = recompute_pool_indices(graph, model) if lean_pools and schedule.num_streams > 1 else 0
    problems += verify_generated(graph, dag, schedule.num_streams)
    if problems:
        raise PlanError(f"concur produced an invalid plan for {type(model).__name__} "
                        f"({schedule.scheduler}, {schedule.num_streams} streams); please report this bug: "
                        f"{problems[:5]}")
    runtime = StreamRuntime(schedule.num_streams, event_count(schedule), weight_grad_stream=splits > 0,
                            caller_memory=caller_memory and schedule.num_streams > 1)
    setattr(traced, runtime_attr, runtime)
    generated = fx.GraphModule(traced, graph, f"Concur{type(model).__name__}")
    return Plan(schedule, dag, generated, runtime, runtime_attr, traced, splits, pools)


def build_plan(model: torch.nn.Module, example_inputs: tuple, streams: int, scheduler: str,
               cost_model: CostModel | None = None, leaf_modules: LeafSpec = (),
               split_weight_grads: bool = False) -> Plan:
    """Return a verified plan running ``model`` on up to ``streams`` streams, with no keep-or-drop decision.

    With ``split_weight_grads`` and more than one stream, the weight gradients
    of plain Conv2d/Linear layers run on one more stream in backward
    (:mod:`concur.fx.weight_grads`); a one-stream plan stays exactly serial.

    Raises:
        CaptureError: the model cannot be traced, or its trace fails where the model runs.
        ExampleInputError: the model itself raises on ``example_inputs``.
        PlanError: the schedule or the generated code violates a dependency (a concur bug).
    """
    traced, dag = analyse(model, example_inputs, cost_model, leaf_modules)
    prologue, _, schedule = schedule_ops(dag, streams, scheduler, cuda_device(model, example_inputs))
    return generate_plan(model, traced, dag, prologue, schedule, split_weight_grads)

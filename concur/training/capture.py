"""Capturing one graph of a training step: warm-up, capture, and what a failed capture falls back to.

A graph must capture exactly the user's next step, so whatever warm-up
changes is put back (:mod:`concur.training.snapshot`). Warm-up runs forward
and backward on the runner's side stream (:mod:`concur.training.graph_runner`);
with the step's own update (:mod:`concur.training.captured_optim`), no
accumulation and no ``before_step`` it runs no optimizer step, only the
update on one-element stand-ins, so only buffers (BatchNorm statistics) and
the RNG state are saved and put back, not a copy of the model: the first
replay is exactly the user's first step. Otherwise warm-up runs whole steps
(optimizers make their state lazily) and the snapshot holds everything.

A capture that fails for another reason than memory is tried once more in
a new pool. One that runs out of memory keeps the streams where memory
allows: a compiled step first takes its backward graphs' multi-stream
programs down, to 2 streams, then with aten's calls on the caller's stream,
then to one (the step's peak is at the start of backward); an unfused step
(:data:`concur.training.rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY`, on by default)
first captures the same streams again with its side streams' memory and its
whole backward the caller's stream's (:mod:`concur.caller_memory`), then,
on more than 2 streams, tries 2 (:mod:`concur.training.rungs`), its
max-pooling layers saving no indices (:mod:`concur.fx.pool_indices`), whose
bytes are alive at that peak. Where that does not fit, it falls back to
one stream, for this and later input shapes, and then to eager execution;
one warning says what was missing and what runs instead. What the failed
attempt held (its module, graphs, pool and cached blocks) is given back
first (:func:`capture_with_fallback`). The step keeps at most
``max_graphs`` graphs per position of the accumulation cycle and evicts the
least recently used.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from concur import _torch_compat as compat
from concur.caller_memory import available as caller_memory_available
from concur.errors import failure_text
from concur.fx.plan_timing import PendingChoice
from concur.fx.plan import Plan, cuda_device
from concur.training import captured_optim, rungs
from concur.training import trial as trial_policy
from concur.training.gradients import StepGradients, optimized_parameters
from concur.training.graph_runner import Captured
from concur.training.out_of_memory import is_out_of_memory, shortfall
from concur.training.rungs import Rung, describe, stream_rungs
from concur.training.snapshot import Snapshot
from concur.training.status import CaptureLog
from concur.training.step_body import StepBody
from concur.training.trial import OneAtATime, StepTrial

__all__ = ["CapturingStep", "capture_with_fallback", "capture", "capture_programs", "graph_limit",
           "release_cublas_workspaces"]


class CapturingStep(Protocol):
    """What capturing needs of a step (:class:`concur.training.step.TrainStep`, which imports this module): its
    arguments, its modules and graphs by stream count, and the parts that warm up, capture and keep the log."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad_scaler: Any
    requested_streams: int | str
    compile: bool
    accumulate: int
    before_step: Any
    max_graphs: int
    warmup: int
    modules: dict
    backends: dict
    graphs: OrderedDict
    eager_keys: set
    warmed_keys: set
    failed_streams: set
    lean_pools: bool
    caller_memory: bool
    step_decisions: list
    capture_log: CaptureLog
    _trial: StepTrial | OneAtATime | None
    _status_of: Captured | None  # the graph whose status was read last
    _runner: Any  # a CudaGraphRunner, or the CPU tests' emulation
    _hyper: captured_optim.DeviceHyperparameters | None
    _body: StepBody
    _gradients: StepGradients
    _batches: Any  # BatchChecks, which takes the step too

    def _module(self, streams: Rung) -> nn.Module: ...

    def _warn_once(self, message: str) -> None: ...

    def _decide_on_the_step(self, streams: int, forward_backward: Callable[[], Any], inputs: tuple) -> None: ...


def graph_limit(step: CapturingStep) -> int:
    """Return how many graphs ``step`` keeps: ``max_graphs`` per position of the accumulation cycle."""
    return step.max_graphs * min(step.accumulate, 3)  # first, middle and last position of a cycle


CAPTURE_TRIES = 2  # captures of one stream count, where the first fails for another reason than memory


def capture_with_fallback(step: CapturingStep, inputs: tuple, targets: Any, key: tuple,
                          phase: tuple[bool, bool]) -> Captured | None:
    """Return the graph of ``step`` for ``key``, kept in its graphs; None where every stream count failed, and
    the key runs eagerly from now on.

    A capture that fails for another reason than memory (a graph freed by
    another thread mid-capture, say) is tried once more, in a new pool, after
    what it held is given back. One that runs out of memory is not: a
    compiled step first takes its backward graphs' multi-stream programs
    down a step at a time, capturing again after each (:func:`_capture_on`);
    an unfused step first captures the same streams with the caller's
    memory (:func:`_caller_memory_next`), then, on more than 2 streams,
    tries 2 (:func:`concur.training.rungs.stream_rungs`).
    Where that does not fit either, the step drops to one stream. Each rung
    that failed is not tried again, for this and later input shapes;
    one warning says how much memory was missing and what runs instead.
    Eager execution is the last resort, with a warning that says why and how
    to capture again.
    """
    step._batches.admit(inputs, targets)  # a batch the model rejects must not cost later batches their streams
    log = step.capture_log
    missed: list[str] = []  # what each stream count out of memory missed, in the order tried
    why, widest = "", None
    for streams in stream_rungs(step):
        if streams in step.failed_streams or _no_narrower(streams, widest):
            continue  # failed before; or no narrower than the program that just did not fit
        captured, why, memory, attempt = _capture_on(step, inputs, targets, key, streams, phase)
        if captured is None and _caller_memory_next(step, streams, memory):
            # the same streams once more, every activation and the whole backward on the caller's stream
            missed.append(_give_up_on(step, streams, why, memory, attempt)[0])
            step.caller_memory = True
            captured, why, memory, attempt = _capture_on(step, inputs, targets, key, streams, phase)
        if captured is not None:
            if missed:
                lean = _lean_pools_said(step, streams) + _caller_memory_said(step, streams)
                step._warn_once(f"concur.train_step: {'; '.join(missed)}; running it on {describe(streams)}"
                                f"{lean} instead, for this and later input shapes.")
                if lean:  # the status says it too: a program that differs from the plain one in backward
                    log.fallbacks[-1] += f"; on {describe(streams)}{lean}"
            _keep(step, key, captured)
            return captured
        if streams == 1:
            break
        step.failed_streams.add(streams)
        fallback, widest = _give_up_on(step, streams, why, memory, attempt)
        missed.append(fallback)
        if not memory:
            widest = 2  # a failure memory does not explain: fewer side streams would not help, one stream may
        elif not step.compile:
            step.lean_pools = True  # the unfused plans on fewer streams save no max-pooling indices
    log.fallbacks.append(f"capturing the step on 1 stream failed ({why})")
    step._warn_once(f"concur.train_step: {''.join(m + '; ' for m in missed)}capturing the step on 1 stream failed "
                    f"({why}); this input shape runs eagerly, every kernel launched from Python (slower). Once the "
                    "cause is gone (memory freed, a smaller batch), step.recapture() captures again at the next "
                    "call.")
    step.eager_keys.add(key)
    return None


def _give_up_on(step: CapturingStep, streams: Rung, why: str, memory: bool, attempt: int) -> tuple[str, int | None]:
    """Free the module (and the compiled code) of ``streams`` that did not fit or cannot be captured, and what
    its attempt held; log what it missed and return that, with the streams its program ran
    (:func:`_program_width`, read before the module goes)."""
    width = _program_width(step, streams)
    on = describe(width or streams)
    step.modules.pop(streams, None)
    step.backends.pop(streams, None)
    step._runner.failed()
    release_cublas_workspaces(step)
    fallback = (f"the step on {on} does not fit in memory ({why})" if memory else
                f"capturing the step on {on} failed {attempt} times ({why})")
    step.capture_log.fallbacks.append(fallback)
    return fallback, width


def _caller_memory_next(step: CapturingStep, streams: Rung, memory: bool) -> bool:
    """Whether an unfused rung that ran out of memory is tried again with its side streams' memory and its whole
    backward on the caller's stream (:mod:`concur.caller_memory`), before fewer streams: under pressure it
    keeps the streams (GoogLeNet and Inception-v3 b64 under 1.05x the recipe's memory: 1.11x and 1.08x its speed,
    where 2 streams did not fit; :data:`concur.training.rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY`)."""
    return (memory and not step.compile and streams != 1 and not step.caller_memory
            and rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY and caller_memory_available())


def _caller_memory_said(step: CapturingStep, streams: Rung) -> str:
    """", its side streams' memory and its backward the caller's stream's" where that rung's plan runs so."""
    plan = _plan_of(step, streams)
    return ", its side streams' memory and its backward the caller's stream's" \
        if plan is not None and plan.runtime.caller_memory else ""


def release_cublas_workspaces(step: CapturingStep) -> None:
    """Give back the cuBLAS workspaces of every stream (32 MiB each, kept for the process otherwise) where
    ``step`` holds no graph that replays into one; the next warm-up makes those its program needs."""
    if not step.graphs:
        compat.clear_cublas_workspaces()


def _no_narrower(rung: Rung, widest: int | None) -> bool:
    """Whether ``rung`` would need no less than the program that just did not fit (``widest`` streams): a
    stream count no lower than it; one stream is always tried."""
    return rung != 1 and widest is not None and isinstance(rung, int) and rung >= widest


def _plan_of(step: CapturingStep, streams: Rung) -> Plan | None:
    """The plan the unfused module on ``streams`` runs; None where there is none (compiled, or no plan for this
    mode yet)."""
    try:
        return step.modules[streams].plan
    except (KeyError, AttributeError, RuntimeError):
        return None


def _lean_pools_said(step: CapturingStep, streams: Rung) -> str:
    """", its N max-pooling layers saving no indices" where the unfused module on ``streams`` runs a plan that
    recomputes them (:mod:`concur.fx.pool_indices`), else ""."""
    plan = _plan_of(step, streams)
    pools = plan.pool_recomputes if plan is not None else 0
    return f", its {pools} max-pooling layer{'s' if pools != 1 else ''} saving no indices" if pools else ""


def _program_width(step: CapturingStep, streams: Rung) -> int | None:
    """How many streams the unfused module on ``streams`` ran (an ``"auto"`` module picks its own), where known."""
    plan = _plan_of(step, streams)
    if plan is not None:
        return plan.schedule.num_streams
    return streams if isinstance(streams, int) else None


def _capture_on(step: CapturingStep, inputs: tuple, targets: Any, key: tuple, streams: Rung,
                phase: tuple[bool, bool]) -> tuple[Captured | None, str, bool, int]:
    """Capture ``key``'s graph with the module on ``streams``; return (the graph or None, why the last attempt
    failed, whether it ran out of memory, attempts made).

    A failure for another reason than memory is tried again, up to
    :data:`CAPTURE_TRIES` attempts. Out of memory, a compiled step whose
    forward and backward graphs both run on streams takes its backward
    graphs' programs down a step (to 2 streams, then with aten's calls on the
    caller's stream, then to inductor's own call) and tries again
    (:func:`_narrow`); the warning that says so comes where a capture
    succeeds.
    """
    log = step.capture_log
    why, memory, attempt, narrowed, narrowed_to = "", False, 0, "", ""
    while attempt < CAPTURE_TRIES:
        attempt += 1
        try:
            captured = capture_or_start_trial(step, inputs, targets, key, streams, phase)
        except Exception as exc:  # noqa: BLE001 - out of memory, or an op or moment a graph cannot capture
            memory = is_out_of_memory(exc)
            why = shortfall(exc) if memory else failure_text(exc)
            captured = None
        # outside the except block: its traceback no longer holds the failed attempt's tensors
        if captured is not None:
            log.recovered += attempt > 1 and not narrowed
            if narrowed:
                step._warn_once(f"concur.train_step: the step with every graph on streams does not fit in memory "
                                f"({narrowed}); {_backward_on(narrowed_to)}, its forward graphs keep theirs, for "
                                "this and later input shapes.")
            return captured, why, memory, attempt
        log.failures += 1
        step._trial = None
        step._runner.failed()
        if not memory:
            continue
        narrowed_to = _narrow(step, streams, why)
        if not narrowed_to:
            break
        # the same module, its backward graphs on fewer streams: attempts of their own; the warning, like the
        # status, says what the last of them missed
        narrowed, attempt = why, 0
    return None, why, memory, attempt


def _backward_on(how: str) -> str:
    return f"its backward graphs run {how}"


def _narrow(step: CapturingStep, streams: Rung, why: str) -> str:
    """Where the compiled step on ``streams`` ran out of memory, take its backward graphs' multi-stream programs
    a step down (:meth:`concur.inductor.stream_backend.ConcurBackend.narrow_plans`) and log it; return what they
    run now, in words, or "" where nothing changed (an unfused step, which drops to its one-stream module; no
    forward graph that would keep streams; nothing left to take down)."""
    backend = step.backends.get(streams) if step.compile else None
    to = "" if backend is None else backend.narrow_plans(f"the step with it on streams did not fit in memory ({why})")
    if not to:
        return ""
    release_cublas_workspaces(step)  # the backward's side streams'
    step.capture_log.fallbacks.append(f"the step with every graph on streams does not fit in memory ({why}); "
                                      f"{_backward_on(to)}, its forward graphs keep theirs")
    return to


def _keep(step: CapturingStep, key: tuple, captured: Captured) -> None:
    """Keep ``captured`` as ``key``'s graph, evicting the least recently used beyond :func:`graph_limit`."""
    if len(step.graphs) >= graph_limit(step):
        step.graphs.popitem(last=False)
        step._warn_once(f"concur.train_step: more than {graph_limit(step)} captured graphs (input "
                        "shapes, cycle positions, train/eval or frozen states); evicting the least "
                        "recently used.")
    step.graphs[key] = captured
    step.warmed_keys.add(key)


def capture_or_start_trial(step: CapturingStep, inputs: tuple, targets: Any, key: tuple, streams: Rung,
                           phase: tuple[bool, bool]) -> Captured:
    """Capture ``key``'s graph; where a decision is left to the first calls, capture every program and start
    their trial (:mod:`concur.training.trial`), returning the predicted one's graph.

    Every program at once needs more memory than one: where capturing them
    runs out of it, or where :data:`concur.training.trial.SIDE_BY_SIDE` is
    off, the predicted program alone is captured, and the first calls time
    it and then the one-stream program, each alone
    (:class:`concur.training.trial.OneAtATime`). Where they fail for another
    reason, the prediction decides (not cached), as where a timing before
    the step fails. Where the predicted program alone does not fit either,
    :func:`capture_with_fallback` drops to fewer streams.
    """
    choice = trial_choice(step, streams)
    failure, memory = None, False
    if choice is not None and not trial_policy.SIDE_BY_SIDE:
        return _capture_predicted_alone(step, inputs, targets, key, streams, phase,
                                        "to hold one program's memory at a time", failure=None, cached=True)
    if choice is not None:
        try:
            step._trial = capture_trial(step, inputs, targets, key, streams, phase, choice)
            return step._trial.programs[choice.program_of_default()]
        except Exception as exc:  # noqa: BLE001 - out of memory, most likely: one program may still fit
            failure, memory = failure_text(exc), is_out_of_memory(exc)
    if failure is not None:  # outside the except block: its traceback no longer holds the programs' tensors
        step.capture_log.failures += 1
        step._trial = None
        step._runner.failed()
        if memory:
            return _capture_predicted_alone(step, inputs, targets, key, streams, phase,
                                            "side by side they do not fit in memory", failure, cached=False)
        step.step_decisions.append(step._module(streams).settle(None, failure))
    return capture(step, inputs, targets, streams, phase, warmup=_warmup_of(step, key))


def _warmup_of(step: CapturingStep, key: tuple) -> int | None:
    """A shape warmed up before (a graph dropped by the trial or evicted) needs one pass, not the warm-up."""
    return 1 if key in step.warmed_keys else None


def _capture_predicted_alone(step: CapturingStep, inputs: tuple, targets: Any, key: tuple, streams: Rung,
                             phase: tuple[bool, bool], why: str, failure: str | None, cached: bool) -> Captured:
    """Capture the predicted program alone and start timing it, then the one-stream program, on the first calls
    (:class:`concur.training.trial.OneAtATime`; ``why``: said in the decision's line; ``cached``: whether the
    decision may be cached, not where memory ran short, which a later run need not share). Where it cannot be
    captured, the prediction decides, on ``failure`` (the capture of every program at once that ran out of
    memory) or on this capture's own failure, and the error goes to :func:`capture_with_fallback`."""
    module = step._module(streams)
    module.time_predicted_alone(why, cached)
    try:
        captured = capture(step, inputs, targets, streams, phase, warmup=_warmup_of(step, key))
    except Exception as exc:
        step.step_decisions.append(module.settle(None, failure or failure_text(exc)))
        raise
    step._trial = OneAtATime(key, [None, captured], device=cuda_device(module, inputs))
    return captured


def capture_one_stream_of(step: CapturingStep, trial: OneAtATime, inputs: tuple, targets: Any,
                          phase: tuple[bool, bool]) -> None:
    """Free the predicted program ``trial`` timed and capture its one-stream program in a new pool, kept as the
    graph of the trial's shape. Where it cannot be captured, the prediction decides and the trial ends (the
    shape's next capture is the ladder's)."""
    streams = trial.programs[1].streams
    module = step._module(streams)
    trial.programs[1] = None  # its pool goes back only once no graph captured into it is referred to
    step.graphs.clear()
    step._gradients.bound = step._status_of = None
    step._runner.new_pool()
    release_cublas_workspaces(step)  # the predicted program's side streams': the one-stream program uses none
    module.run_plan(module.pending_choice().one_stream)
    try:
        captured = capture(step, inputs, targets, streams, phase, warmup=1)
    except Exception as exc:  # noqa: BLE001 - it needs less than the program that fitted; should it not, say why
        why = failure_text(exc)
        captured = None
    if captured is None:
        step.capture_log.failures += 1
        step._trial = None
        step._runner.failed()
        step.step_decisions.append(module.settle(None, why))
        return
    trial.programs[0] = captured
    _keep(step, trial.key, captured)


def trial_choice(step: CapturingStep, streams: Rung) -> PendingChoice | None:
    """The decision ``step``'s first calls time (:mod:`concur.training.trial`), where this capture starts it:
    the first capture of a module whose plan has one pending (a first call, a model changed since), while no
    other trial runs."""
    if step._trial is not None or step.compile:
        return None
    return getattr(step._module(streams), "pending_choice", lambda: None)()


def capture_trial(step: CapturingStep, inputs: tuple, targets: Any, key: tuple, streams: Rung,
                  phase: tuple[bool, bool], choice: PendingChoice) -> StepTrial:
    """Capture the step once with each of ``choice``'s programs, one stream first; return their trial.

    Every program warms up before the first capture, so that no warm-up's
    activations (outside the pool) are alive beside the graphs already
    captured. The graphs share the step's pool and static batch. The caching
    allocator reuses a free block only on the stream that allocated it, so
    the one-stream program is captured first: the others' caller-stream
    buffers reuse its blocks and only their side-stream buffers add to the
    pool. Programs after the first warm up with one pass (the first did the
    lazy initialisation; the pass makes their side streams' own). The module
    runs the predicted candidate again afterwards, for any other graph
    captured before the trial ends.
    """
    module = step._module(streams)
    programs = choice.programs
    captured = capture_programs(step, inputs, targets, streams, phase, programs,
                                [step.warmup] + [1] * (len(programs) - 1))
    module.run_plan(programs[choice.program_of_default()])
    return StepTrial(key, captured, device=cuda_device(module, inputs))


def backward_from_none(step: CapturingStep, module: nn.Module, inputs: tuple, targets: Any,
                       optimized: set[torch.Tensor]) -> list[torch.Tensor]:
    """Return the parameters of ``optimized`` that one warm-up forward and backward from no gradients reached
    (in the model's order), their gradients freed."""
    for p in optimized:
        p.grad = None
    step._body.backward(step._body.loss(module, inputs, targets))
    reached = [p for p in step.model.parameters() if p.grad is not None and p in optimized]
    for p in reached:
        p.grad = None
    return reached


def capture(step: CapturingStep, inputs: tuple, targets: Any, streams: Rung, phase: tuple[bool, bool],
            warmup: int | None = None) -> Captured:
    """Warm up on the side stream, capture, and put back what warm-up changed; return the captured graph.

    ``warmup`` passes (the step's ``warmup`` where None) of forward and
    backward, or of whole steps, run before the capture.
    """
    return capture_programs(step, inputs, targets, streams, phase, [None],
                            [step.warmup if warmup is None else warmup])[0]


def capture_programs(step: CapturingStep, inputs: tuple, targets: Any, streams: Rung, phase: tuple[bool, bool],
                     plans: list[Any], warmups: list[int]) -> list[Captured]:
    """Warm up each of ``plans`` (None: the module's own), then capture each; put back what warm-up changed.

    The graphs share one static batch. The lean case (``accumulate=1``, the
    step's own update, no ``before_step``) warms up forward and backward
    only, and the update on one-element stand-ins, so it saves only buffers
    and RNG state. Otherwise warm-up runs whole steps and the snapshot holds
    everything.
    """
    module = step._module(streams)
    runner = step._runner
    fresh = step.accumulate == 1
    lean = fresh and step._hyper is not None and step.before_step is None
    optimized = set(optimized_parameters(step.optimizer))
    # parameters outside the optimizer keep accumulating, as in the plain loop: theirs are saved
    others = [p for p in step.model.parameters() if p not in optimized and p.grad is not None]
    snapshot = Snapshot(step.model, step.optimizer, weights=not lean, grad_scaler=step.grad_scaler,
                        grads_of=others)

    def use(plan: Any) -> None:
        if plan is not None:
            module.run_plan(plan)

    if fresh:  # a pool the step left (concur.training.trial) holds no gradient of the user's once these go
        for p in optimized:
            p.grad = None
    runner.release_old_pool()
    static_inputs, static_targets = _copy_static_batch(step, inputs, targets)
    try:
        bodies = []
        with runner.side_stream():
            for plan, warmup in zip(plans, warmups):
                use(plan)
                reached = backward_from_none(step, module, static_inputs, static_targets, optimized)
                if step.compile and streams != 1:  # every graph of this shape has decided by now
                    step._decide_on_the_step(streams, lambda: backward_from_none(
                        step, module, static_inputs, static_targets, optimized), static_inputs)
                owned = None
                if not fresh:  # allocated on the caller's stream, outside every graph: all graphs share them
                    owned = step._gradients.own(reached)
                update = captured_update(step, reached)
                body = functools.partial(step._body.micro_step, module, static_inputs, static_targets, phase,
                                         optimized_parameters(step.optimizer), owned, update)
                if lean:
                    for _ in range(warmup - 1):
                        backward_from_none(step, module, static_inputs, static_targets, optimized)
                    getattr(update, "warm_up", lambda: None)()
                else:
                    for _ in range(max(warmup - 1, 1)):  # at least one step: optimizers make state lazily
                        body()
                bodies.append((plan, body))
        if fresh:
            for p in optimized:  # free warm-up's gradients before capture, for the graph's own
                p.grad = None
        captured = []
        for plan, body in bodies:
            use(plan)
            graph, (loss, grads) = runner.capture(body, step)
            step.capture_log.captures += 1
            captured.append(Captured(graph, static_inputs, static_targets, loss, streams, grads))
    finally:
        snapshot.restore()
        runner.synchronize()
    return captured


def _copy_static_batch(step: CapturingStep, inputs: tuple, targets: Any) -> tuple[tuple, Any]:
    """Return copies of the batch for the graphs to read, each in a block of its own.

    The static batch and the cuBLAS workspaces (32 MiB a stream and thread,
    made at the first matrix product) live as long as the graph. Made while
    the cache holds freed blocks (the batch check's activations, a plan's
    analysis), each takes a piece of a larger block, and the rest of that
    block's segment stays reserved beside the graph's pool, where the
    capture cannot have it (Inception-v3 b64 captured again after its
    trial: 86 MB held so, where its margin under 1.05x the recipe's memory
    is 83). So the workspaces (where no graph replays into them) and the
    cache are given back first; the warm-up makes the workspaces it needs.
    """
    release_cublas_workspaces(step)
    step._runner.empty_cache()
    static_inputs = tuple(_detached_copy(x) for x in inputs)
    static_targets = _detached_copy(targets) if isinstance(targets, torch.Tensor) else \
        type(targets)(_detached_copy(t) for t in targets)
    return static_inputs, static_targets


def _detached_copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def captured_update(step: CapturingStep, reached: list[torch.Tensor]) -> Callable[[], Any]:
    """Return the update the graph captures: the device-tensor one for SGD/Adam/AdamW, else ``optimizer.step``."""
    if step._hyper is None:
        return step.optimizer.step
    compat.note_optimizer_stepped(step.optimizer)
    return captured_optim.build_update(step.optimizer, step._hyper, reached)

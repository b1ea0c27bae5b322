"""One training step (forward, loss, backward, optimizer step) as a replayed CUDA graph with streams inside.

At small batches eager PyTorch is bound by the CPU launching kernels, and
streams in eager mode only add launch work. Inside a captured CUDA graph the
launches cost nothing at replay, so the concurrency of the plan shows. Hence
the whole step is captured once per input shape and replayed, and it should
cost no more than PyTorch's own whole-step capture (``experiments/peers.py``):

- The body. Eagerly, in warm-up and under capture a call runs the plain
  loop's body, in the order of PyTorch's recipes
  (:mod:`concur.training.step_body`).
- Gradients. With ``accumulate=1`` backward writes fresh gradients into the
  graph's memory, as in PyTorch's recipe; with accumulation into buffers the
  step owns. After each call ``p.grad`` shows the tensors the replayed graph
  wrote (:mod:`concur.training.gradients`).
- The update. SGD, Adam and AdamW are captured as the step's own foreach
  update reading hyperparameters from device tensors written before each
  replay (:mod:`concur.training.captured_optim`), so every ``lr_scheduler``
  works on the user's plain floats. Other optimizers, and fused ones stepped
  by a GradScaler, keep their own ``step()``; their graphs are keyed on the
  hyperparameter values, so a new value is a new capture (warned once).
- Setup. Warm-up runs on one side stream, and what it changes is put back,
  so the first replay is exactly the user's first step; a failed capture
  falls back to one stream and then to eager execution, with one warning
  each (:mod:`concur.training.capture`). The graphs of a step share one
  memory pool (:mod:`concur.training.graph_runner`).
- Streams. With ``compile=True`` each graph decides its streams at its first
  call; where a GPU can time it, the step then times forward and backward
  captured with those plans against inductor's own calls and keeps the plans
  only if the step is faster (:mod:`concur.training.step_streams`).
- Everything else the trace read from Python is part of the graph's key
  (:mod:`concur.training.fingerprint`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.nn as nn

from concur import _torch_compat as compat
from concur.dag import decide
from concur.dag.annotate import cuda_device_in, tensors_in
from concur.fx import module as api
from concur.inductor.stream_backend import ConcurBackend, backend
from concur.training import captured_optim
from concur.training.arguments import as_tuple as _as_tuple, check_arguments, check_optimizer, check_streams, \
    make_capturable, split_option
from concur.training.batch_checks import BatchChecks
from concur.training.capture import capture_one_stream_of, capture_with_fallback, release_cublas_workspaces
from concur.training import rungs
from concur.training.rungs import Rung, stream_rungs
from concur.training.fingerprint import ModelFingerprint, hyperparameter_key
from concur.training.gradients import StepGradients
from concur.training.graph_runner import Captured, batch_tensors, graph_runner as _graph_runner
from concur.training.step_body import BeforeStep, StepBody
from concur.training.status import CaptureLog, StepStatus
from concur.training.step_streams import decide_step_streams
from concur.training.trial import OneAtATime, StepTrial, several_ranks

__all__ = ["TrainStep", "train_step"]

FORMAT = 2  # of a saved step: 1 held the arguments as a tuple, 2 by name
# train_step's arguments by name; also the order in which a saved step of format 1 (a tuple) holds them
_ARGUMENTS = ("model", "loss_fn", "optimizer", "example_batch", "streams", "cuda_graph", "scheduler", "max_graphs",
              "warmup", "compile", "amp_dtype", "grad_scaler", "compile_options", "accumulate", "before_step",
              "stream_priority", "split_weight_grads")


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple([(t.shape, t.dtype, t.device) for t in tensors])


class TrainStep:
    """Callable ``step(inputs, targets) -> loss`` running one optimizer step; see :func:`train_step`."""

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 example_batch: tuple, streams: int, cuda_graph: bool, scheduler: str,
                 max_graphs: int, warmup: int, compile: bool = False,
                 amp_dtype: torch.dtype | None = None,
                 grad_scaler: "torch.amp.GradScaler | None" = None,
                 compile_options: dict[str, Any] | None = None,
                 accumulate: int = 1, before_step: BeforeStep | None = None, stream_priority: bool = True,
                 split_weight_grads: bool | None = None):
        self._arguments = dict(model=model, loss_fn=loss_fn, optimizer=optimizer, example_batch=example_batch,
                               streams=streams, cuda_graph=cuda_graph, scheduler=scheduler, max_graphs=max_graphs,
                               warmup=warmup, compile=compile, amp_dtype=amp_dtype, grad_scaler=grad_scaler,
                               compile_options=compile_options, accumulate=accumulate, before_step=before_step,
                               stream_priority=stream_priority, split_weight_grads=split_weight_grads)
        self.stream_priority = stream_priority
        inputs, _ = example_batch
        self.compile_options = dict(compile_options or {})
        self.split_weight_grads = split_option(split_weight_grads, self.compile_options, compile, cuda_graph)
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.requested_streams = streams
        self.scheduler = scheduler
        self.compile = compile
        self.amp_dtype = amp_dtype
        self.max_graphs, self.warmup = max_graphs, warmup
        self.accumulate, self.before_step = accumulate, before_step
        self.micro = 0  # position of the next call in the accumulation cycle
        self._body = StepBody(model, loss_fn, optimizer, amp_dtype, self.grad_scaler, accumulate, before_step)
        self._example = _as_tuple(inputs)  # plans for other stream counts are built from it
        self.modules: dict[int, nn.Module] = {}
        self.backends: dict[int, ConcurBackend] = {}  # with compile=True: what each backend compiled
        self.failed_streams: set[Rung] = set()  # rungs whose capture failed: not tried again
        # after a multi-stream capture ran out of memory, the unfused plans built next save no max-pooling indices
        self.lean_pools = rungs.LEAN_POOLS_FIRST
        # and, first, launch their side streams' ops with the caller's memory and backward (concur.caller_memory)
        self.caller_memory = False
        on_cuda = any(t.is_cuda for t in tensors_in(inputs)) and torch.cuda.is_available()
        self._runner = _graph_runner(on_cuda, stream_priority) if cuda_graph else None
        self._batches = BatchChecks(self, streams)  # builds the plan, then tries example_batch on loss_fn too
        if cuda_graph and self._runner is None:
            warnings.warn("concur.train_step: no CUDA inputs, so the concurrent plan runs eagerly "
                          "in issue order (same results as the plain loop).", stacklevel=3)
        self.cuda_graph = self._runner is not None
        # Capture warms up on whole steps, which move the loss scale: a scaler whose state cannot be put
        # back would start the first replay from another scale than the plain loop's first step.
        unreadable = compat.grad_scaler_unreadable(self.grad_scaler) if self.grad_scaler is not None else None
        if self.cuda_graph and unreadable is not None:
            warnings.warn(f"concur.train_step: the GradScaler's loss scale cannot be saved and put back after the "
                          f"warm-up steps a CUDA graph capture runs ({unreadable}); running the concurrent plan "
                          "eagerly, with the same results as the plain loop.", stacklevel=3)
            self.cuda_graph, self._runner = False, None
        # Under GradScaler a plain optimizer asks found_inf.item() on the host, which a graph
        # cannot capture; fused ones skip an overflowing step on the device.
        if self.cuda_graph and self.grad_scaler is not None and not compat.enable_device_side_amp_skip(optimizer):
            warnings.warn(f"concur.train_step: {type(optimizer).__name__} under GradScaler checks for "
                          "infinities on the host, which a CUDA graph cannot capture; running the "
                          "concurrent plan eagerly. Use SGD, Adam or AdamW (made fused=True "
                          "automatically) to keep the graph.", stacklevel=3)
            self.cuda_graph, self._runner = False, None
        self._fingerprint = ModelFingerprint(model, optimizer)
        self._groups = captured_optim.GroupsWatch(optimizer)  # the hyperparameter key is read again only on a change
        self._hyperparameters: tuple = ()
        self._hyper: captured_optim.DeviceHyperparameters | None = None
        self._baked_reason = ""  # why hyperparameters are baked into graphs (and keyed on), if they are
        if self.cuda_graph:
            check_optimizer(optimizer)
            reason = "it is stepped by a GradScaler" if self.grad_scaler is not None else \
                captured_optim.unsupported_reason(optimizer)
            if reason is None:
                self._hyper = captured_optim.DeviceHyperparameters(optimizer)
            else:
                self._baked_reason = reason
                make_capturable(optimizer)
            loads = self._fingerprint.loads
            optimizer.register_load_state_dict_post_hook(lambda opt: loads.__setitem__(0, loads[0] + 1))
        self._gradients = StepGradients(optimizer, accumulate)
        self._last_baked: tuple | None = None
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.eager_keys: set[tuple] = set()
        self.warmed_keys: set[tuple] = set()  # graph keys captured before: a capture again warms up once
        # the decisions over the whole step: compile=True (concur.training.step_streams), or unfused, on the first
        # calls (concur.training.trial)
        self.step_decisions: list[decide.Decision] = []
        self._trial: StepTrial | OneAtATime | None = None
        self._warned: set[str] = set()
        self.capture_log = CaptureLog()
        self._status_of: Captured | None = None  # the graph the status was last read for

    def __getstate__(self) -> dict:
        """What a saved step keeps: its arguments by name (model, optimizer, ...) and its place in the cycle.

        Captured graphs, compiled modules, streams and device-side hyperparameters belong to one
        process and device, and none of them can be pickled; a loaded step builds them again from
        its arguments, as a new ``train_step`` would (its first call captures).
        """
        return {"format": FORMAT, "arguments": dict(self._arguments), "micro": self.micro}

    def __setstate__(self, state: dict) -> None:
        saved_format = state.get("format", 1)
        if saved_format > FORMAT:
            raise ValueError(f"concur.train_step: this step was saved by a newer concur (format {saved_format}; "
                             f"this one reads up to {FORMAT}). Upgrade concur, or build the step again with "
                             "train_step(...) and load the model's and optimizer's state_dict.")
        arguments = state["arguments"]
        if isinstance(arguments, tuple):  # format 1: the arguments in order
            arguments = dict(zip(_ARGUMENTS, arguments))
        with warnings.catch_warnings():  # the saved step warned about its setup already
            warnings.simplefilter("ignore")
            self.__init__(**arguments)
        self.micro = state["micro"]

    @property
    def deciding(self) -> bool:
        """Whether the step's calls are still timing its programs against each other (:mod:`concur.training.trial`).

        An unfused captured step with nothing cached for its plan replays its
        multi-stream and one-stream programs on its first calls (each a real
        training step) until their times decide; a benchmark warms up
        until this is False, so that it times the program the step keeps.
        """
        return self._trial is not None

    @property
    def status(self) -> StepStatus:
        """How the last call ran (captured or eagerly, on how many streams, and why) and what the captures went
        through; ``print(step.status)`` gives it in one line."""
        log = self.capture_log
        return StepStatus(log.mode, log.streams, self.requested_streams, log.why, log.captures, log.failures,
                          log.recovered, tuple(log.fallbacks))

    def recapture(self) -> None:
        """Capture again at the next call where a capture failed before (eager input shapes, stream counts
        dropped after a failure): once the cause is gone, e.g. memory freed or a smaller batch."""
        self.eager_keys.clear()
        self.failed_streams.clear()
        self.lean_pools = rungs.LEAN_POOLS_FIRST
        self.caller_memory = False

    def _program_streams(self, captured: Captured) -> int:
        """The streams the program of ``captured`` runs on: its plans' (unfused: the plan it runs; fused: the
        widest graph the backend keeps on streams), one where a plan was dropped."""
        if self.compile:
            backend = self.backends.get(captured.streams)
            return max((g.num_streams for g in backend.graphs), default=1) if backend is not None else 1
        module = self.modules.get(captured.streams)
        try:
            return module.schedule.num_streams if module is not None else 1
        except (AttributeError, RuntimeError):  # a module without a plan for this mode yet
            return captured.streams if isinstance(captured.streams, int) else 1

    def _why_fewer_streams(self, captured: Captured, streams: int) -> str:
        """Why ``captured`` runs ``streams`` streams where more were asked for; "" where it runs what was asked."""
        narrowed = self.compile and getattr(self.backends.get(captured.streams), "narrowed", False)
        if (captured.streams != self.requested_streams or narrowed) and self.capture_log.fallbacks:
            return self.capture_log.fallbacks[-1]
        asked = self.requested_streams
        if streams == 1 and (asked == "auto" or asked > 1):
            dropped = [d for d in self.step_decisions if not d.keep]
            return f"{dropped[-1].source}: {dropped[-1].reason}" if dropped else "the plans keep one stream"
        return ""

    @property
    def module(self) -> nn.Module:
        """The concurrent module the step runs: the requested stream count's, or, where that did not fit in
        memory or could not be captured, the rung it fell back to (:func:`concur.training.rungs.stream_rungs`)."""
        ran = [s for s in stream_rungs(self) if s not in self.failed_streams and s in self.modules]
        return self._module(ran[0] if ran else self.requested_streams)

    def _module(self, streams: Rung) -> nn.Module:
        if streams not in self.modules:
            if self.compile:
                # dynamic=False: a new batch size gets its own static graph, as CUDA graphs need
                self.backends[streams] = backend(streams=streams, scheduler=self.scheduler,
                                                 **self.compile_options)
                self.modules[streams] = torch.compile(self.model, backend=self.backends[streams], dynamic=False)
            else:
                # the runs that annotate and time the plan: on setup's stream, in the step's precision
                with self.setup_stream(), self._body.autocast(self._example):
                    self.modules[streams] = api.optimize(self.model, self._example, streams=streams,
                                                         scheduler=self.scheduler,
                                                         split_weight_grads=self.split_weight_grads,
                                                         measure=api.DEFERRED if self._can_trial() else True,
                                                         lean_pools=self.lean_pools,
                                                         memory_model=rungs.MEMORY_MODEL_FIRST,
                                                         caller_memory=self.caller_memory)
        return self.modules[streams]

    def _can_trial(self) -> bool:
        """Whether a new decision between plans is timed on the first calls (:mod:`concur.training.trial`).

        Captured single-rank steps without accumulation: ranks must replay
        the same program every call, and the graphs of an accumulation cycle
        add into one set of gradients.
        """
        if self._runner is None or self.accumulate != 1 or several_ranks():
            return False
        device = cuda_device_in(self._example) or torch.device("cpu")
        return self._runner.can_time(device)

    def setup_stream(self) -> contextlib.AbstractContextManager:
        """Where setup runs the model outside warm-up (annotating the plan, trying a batch): the warm-up's stream.

        The caching allocator keeps freed blocks per stream, and cuBLAS a
        workspace per stream (32 MiB on an H100), so work on the caller's
        stream would leave a second set beside the warm-up's, held for good.
        """
        return self._runner.side_stream() if self._runner is not None else contextlib.nullcontext()

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        inputs = _as_tuple(inputs)
        self._check_tree()
        phase = self._phase()
        try:  # a batch the model rejects raises BatchError from this line, not from deep in the plan
            if self.cuda_graph:
                loss = self._graph_call(inputs, targets, phase)
            else:
                module = self.module
                loss = self._body.eager(inputs, targets, module, phase)
                log = self.capture_log
                if log.mode != "eager":  # it runs eagerly for good: said once, not on every call
                    log.mode, log.streams, log.why = "eager", getattr(getattr(module, "schedule", None),
                                                                      "num_streams", None), \
                        "not captured: cuda_graph=False, or no CUDA inputs (the plan runs in issue order)"
        except Exception as exc:
            error = self._batches.explain(exc, inputs, targets)  # None: not the batch's fault
            if error is None:
                raise
            raise error
        self.micro = (self.micro + 1) % self.accumulate
        return loss

    def _phase(self) -> tuple[bool, bool]:
        """(first, last): whether this call starts an accumulation cycle (zero gradients) and ends it (step)."""
        return self.micro == 0, self.micro == self.accumulate - 1

    # --- graphs --------------------------------------------------------------------------------

    def _check_tree(self) -> None:
        """If the module tree changed (a submodule replaced), rebuild the plans: an old one calls the old module."""
        if self._fingerprint.tree_changed():
            self.modules.clear()
            self.backends.clear()
            self._trial = None
            self.warmed_keys.clear()

    def _state_key(self) -> int:
        """What a captured step depends on besides input shapes, as a number (:meth:`ModelFingerprint.state_id`)."""
        return self._fingerprint.state_id(self._hyperparameter_key())

    def _hyperparameter_key(self) -> tuple:
        """:func:`hyperparameter_key`, worked out again only where the param groups changed (:class:`GroupsWatch`)."""
        if not self._groups.unchanged():
            self._hyperparameters = hyperparameter_key(self.optimizer, device_values=self._hyper is not None)
        return self._hyperparameters

    def _graph_call(self, inputs: tuple, targets: Any, phase: tuple[bool, bool]) -> torch.Tensor:
        # Everything before replay() is host time the device may wait for (a loop that reads the loss
        # every step): keep it to one key and one lookup.
        batch = batch_tensors(inputs, targets)
        key = (_signature(batch), phase, self._state_key())  # small: hashed again by each lookup below
        if isinstance(self._trial, OneAtATime) and self._trial.key == key and self._trial.one_stream_due():
            capture_one_stream_of(self, self._trial, inputs, targets, phase)
        captured = self.graphs.get(key)
        baked = self._hyperparameter_key() if self._hyper is None else None
        if captured is None and key not in self.eager_keys:
            self._warn_if_values_are_baked(baked)
            captured = capture_with_fallback(self, inputs, targets, key, phase)
        self._last_baked = baked
        log = self.capture_log
        if captured is None:
            log.mode, log.streams, log.why = "eager", 1, (log.fallbacks or ["no capture succeeded"])[-1]
            return self._body.eager(inputs, targets, self._module(1), phase)
        if captured is not self._gradients.bound:
            self.graphs.move_to_end(key)
        trial = self._trial if self._trial is not None and self._trial.key == key else None
        if trial is not None:
            program, captured = trial.next_program()
        if captured is not self._status_of:  # host time: the status is read again only for another graph
            self._status_of = captured
            log.mode, log.streams = "captured", self._program_streams(captured)
            log.why = self._why_fewer_streams(captured, log.streams)
        if self._hyper is not None:
            self._hyper.refresh()
        if not phase[0]:
            self._gradients.carry_into(captured)
        for static, new in zip(captured.static_batch, batch):
            static.copy_(new, non_blocking=True)
        if trial is None:
            captured.graph.replay()
        else:
            trial.replayed(program, self._runner.timed_replay(captured.graph))
        self._gradients.bind(captured)
        # A clone: the static loss is overwritten by the next replay, and users keep losses.
        loss = captured.static_loss.detach().clone()
        if trial is not None:
            self._settle_trial(trial)
        return loss

    def _settle_trial(self, trial: StepTrial | OneAtATime) -> None:
        """Where the trial's rounds decide, free every graph; the next call captures the chosen program alone.

        In a new pool: the trial's pool holds the blocks of every program
        (the one-stream program's, and the others' side-stream blocks), which
        the chosen one alone would keep reserved for the life of the step.
        The capture warms up once. Timed one at a time, where one stream wins
        its graphs stay: the one-stream program's pool holds nothing else.
        """
        rounds = trial.decided()
        if rounds is None:
            return
        self._trial = None
        # the module that started the trial: the one asked for, or fewer streams where that did not fit
        decision = self.modules[trial.programs[0].streams].settle(rounds)
        self.step_decisions.append(decision)
        if isinstance(trial, OneAtATime) and not decision.keep:
            return
        self.graphs.clear()
        # the pool goes back to the device only once no graph captured into it is referred to anywhere
        self._gradients.bound = self._status_of = None
        self._runner.new_pool()
        release_cublas_workspaces(self)  # the trial's: the chosen program's warm-up makes its own

    def _warn_if_values_are_baked(self, values: tuple) -> None:
        # Same groups, other values (a new group is a new layout, not a schedule).
        if self._hyper is None and self._last_baked is not None and len(values) == len(self._last_baked) \
                and values != self._last_baked:
            self._warn_once(f"concur.train_step: the hyperparameters of {type(self.optimizer).__name__} changed "
                            f"after capture; because {self._baked_reason}, its graphs hold the values of their "
                            "capture, so each new value is captured anew (warm-up and capture each time). For a "
                            "schedule that changes every step use SGD, Adam or AdamW without a GradScaler, whose "
                            "hyperparameters the graph reads from device tensors, or cuda_graph=False.")

    def _decide_on_the_step(self, streams: int, forward_backward: Callable[[], Any], inputs: tuple) -> None:
        """Keep the plans installed since the last such decision only if the step is faster with them."""
        backend = self.backends.get(streams)
        if backend is None:
            return
        device = cuda_device_in(inputs) or torch.device("cpu")
        loss_name = getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__qualname__)
        key_parts = (loss_name, str(self.amp_dtype), self.accumulate, self.stream_priority, decide.MARGIN)
        decision = decide_step_streams(backend, forward_backward, self._runner, device, type(self.model).__name__,
                                       key_parts)
        if decision is not None:
            self.step_decisions.append(decision)


def train_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, example_batch: tuple,
               streams: int | str = 4, cuda_graph: bool = True, *, compile: bool = False,
               amp_dtype: torch.dtype | None = None,
               grad_scaler: "torch.amp.GradScaler | None" = None, scheduler: str = "critical_path",
               max_graphs: int = 4, warmup: int = 3, compile_options: dict[str, Any] | None = None,
               accumulate: int = 1, before_step: BeforeStep | None = None,
               stream_priority: bool = True, split_weight_grads: bool | None = None) -> TrainStep:
    """Return ``step(inputs, targets) -> loss`` that trains ``model`` one step per call.

    ``example_batch`` is ``(inputs, targets)``; inputs are a tensor or a tuple
    of the model's positional inputs; ``loss_fn(model_output, targets)``
    returns a scalar. With CUDA and ``cuda_graph=True`` the step (forward with
    the concurrent plan, backward, optimizer step) is captured once per input
    shape and replayed; ``streams=1`` is the serial baseline through the same
    path. Without CUDA it runs eagerly in the plan's issue order.

    Use it as the body of a plain loop: ``lr_scheduler.step()``,
    ``model.eval()``/``train()`` of any submodule, ``requires_grad_(False)``,
    ``optimizer.add_param_group`` and ``load_state_dict`` between calls all
    take effect under graphs too (hyperparameters of SGD, Adam and AdamW are
    read from device tensors refreshed before each replay; other changes, and
    hyperparameters of other optimizers, give a new capture).

    ``before_step(model, optimizer)`` runs after backward and before the
    optimizer step, inside the graph: gradient clipping, e.g.
    ``before_step=lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)``
    (or ``clip_grad_value_``). Under a GradScaler the gradients are unscaled
    first (``scaler.unscale_``), as in PyTorch's AMP recipe. Under graphs it
    runs at capture only: it must not read tensors on the host (``.item()``,
    ``error_if_nonfinite=True``), and Python values it reads are frozen.

    ``accumulate=k`` accumulates gradients over k calls, PyTorch's recipe:
    each call backpropagates ``loss / k`` (and returns the loss undivided);
    every k-th call runs ``before_step`` and the optimizer step, and the next
    call starts from zero gradients. Under graphs each position of the cycle
    (first, middle, last) has its own graph; all accumulate into the same
    gradient tensors, which ``p.grad`` shows after each call.

    ``stream_priority=True`` (the default) captures the step on a stream of
    the highest priority, where every plan keeps its critical path; side
    streams keep the default, lowest priority, so their kernels yield SMs to
    the path's (measured faster or equal, never slower: experiments/RESULTS.md).
    ``False`` captures on an ordinary stream.

    ``compile=True`` runs the model through ``torch.compile`` with the concur
    backend (:mod:`concur.inductor.stream_backend`): inductor's fused kernels on the streams,
    forward and backward, still captured whole; ``streams=1`` is then exactly
    ``torch.compile`` plus a whole-step CUDA graph. ``compile_options`` are
    more keyword arguments of :func:`concur.backend` (e.g.
    ``buffer_reuse``).

    ``split_weight_grads`` (plans of more than one stream) runs the weight
    gradients of convolutions and linear layers off backward's critical
    path, on one more low-priority stream: through autograd on the unfused
    path (:mod:`concur.fx.weight_grads`), by splitting each backward
    ``convolution_backward`` on the fused one (the backend option of that
    name, which ``compile_options`` may set instead; both must then agree).
    None (the default) splits on the fused path and on a captured unfused
    step; an unfused step run eagerly (``cuda_graph=False``) keeps its
    layers whole, since there the split's extra autograd nodes cost host
    time every step.

    ``streams="auto"`` weighs each graph's plans on 2, 3 and 4 streams
    against one stream through the same decision as a fixed count, all from
    one trace (unfused) or one compile (``compile=True``): timed together on
    CUDA (the fewest streams within 1% of the fastest, kept only if more
    than 1% faster than one stream, cached on disk), predicted elsewhere
    (the fewest streams within 3% of the best prediction). With
    ``compile=True`` the step then weighs the plans kept over the whole
    captured step, as for a fixed count.

    ``amp_dtype=torch.bfloat16`` runs forward and loss under autocast (the
    same as ``with torch.autocast(...)`` around them in a plain loop).
    For fp16 pass ``amp_dtype=torch.float16`` and a ``torch.amp.GradScaler``:
    each step is then ``scaler.scale(loss).backward(); scaler.step(opt);
    scaler.update()``, as in PyTorch's AMP recipe. Inside a CUDA graph the
    skip of an overflowing step happens on the device: SGD, Adam and AdamW
    are switched to their fused implementations, which support that; other
    optimizers run eagerly with a warning.

    ``max_graphs`` bounds the cached graphs per position of the accumulation
    cycle (least recently used are evicted).

    On CUDA, whether a plan of several streams beats one stream is measured,
    not assumed, and cached on disk per graph, shapes, GPU and torch
    (``CONCUR_MEASURE=0`` leaves it to the prediction). A captured unfused
    step without accumulation measures on its own first calls: it captures
    the step with the plan, then with one stream, one program at a time,
    each call a real training step, until their CUDA-event times decide (16
    calls or more; :attr:`TrainStep.deciding` says when it is done); then
    only the faster graph stays. Other steps time their programs during setup.
    """
    check_arguments(example_batch, grad_scaler, accumulate, before_step)
    check_streams(streams, compile, compile_options)
    return TrainStep(model, loss_fn, optimizer, tuple(example_batch), streams, cuda_graph, scheduler,
                     max_graphs, warmup, compile, amp_dtype, grad_scaler, compile_options, accumulate, before_step,
                     stream_priority, split_weight_grads)

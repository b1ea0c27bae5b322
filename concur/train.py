"""One training step (forward, loss, backward, optimizer step) as a replayed CUDA graph with streams inside.

At small batches eager PyTorch is bound by the CPU launching kernels, and
streams in eager mode only add launch work. Inside a captured CUDA graph the
launches cost nothing at replay, so the concurrency of the plan shows. Hence
the whole step is captured once per input shape and replayed.

Capture needs warm-up iterations (cuBLAS/cuDNN handles, optimizer state,
autograd's lazy buffers) and those *train*. So model parameters, buffers and
optimizer state are snapshotted before warm-up and restored after capture, in
place (the graph keeps the same addresses): the first replay is then exactly
the user's first step. A failed capture restores the snapshot too, then falls
back to fewer streams and finally to eager execution, with one warning each.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from . import _torch_compat as compat
from . import api
from .backend import ConcurBackend, backend
from .annotate import tensors_in


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _signature(inputs: tuple, targets: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype, str(t.device)) for t in tensors_in((inputs, targets)))


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    static_inputs: tuple
    static_targets: Any
    static_loss: torch.Tensor
    streams: int


class _Snapshot:
    """Copies of parameters, buffers, gradients, optimizer, loss-scaler and RNG state, restorable in place.

    The RNG state matters for dropout: warm-up draws masks, and without the
    restore the first replay would draw different masks than the user's first
    eager step, so the same seed would not give the same run. The loss scale
    matters for fp16: warm-up steps may back it off or grow it.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 grad_scaler: "torch.amp.GradScaler | None" = None):
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.scaler_state = (None, None) if grad_scaler is None else \
            tuple(None if t is None else t.clone() for t in compat.grad_scaler_tensors(grad_scaler))
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.tensors = [(t, t.detach().clone()) for t in [*model.parameters(), *model.buffers()]]
        self.grads = {p: (None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()}
        self.state = {(p, k): v.detach().clone() for p, s in optimizer.state.items()
                      for k, v in s.items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def restore(self) -> None:
        for live, saved in self.tensors:
            live.copy_(saved)
        for p, g in self.grads.items():
            p.grad = g
        for p, s in self.optimizer.state.items():
            for k, v in list(s.items()):
                if not isinstance(v, torch.Tensor):
                    continue
                if (p, k) in self.state:
                    v.copy_(self.state[(p, k)])
                else:  # created by warm-up: a fresh optimizer's state is zeros (Adam, SGD momentum)
                    v.zero_()
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.grad_scaler is not None:  # its tensors may first appear during warm-up
            compat.reset_grad_scaler(self.grad_scaler, *self.scaler_state)


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Set ``capturable=True`` where the optimizer has it (Adam, AdamW, ...), moving step counters."""
    for group in optimizer.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if group.get("momentum", 0) and group.get("dampening", 0):
            raise ValueError("train_step with cuda_graph=True does not support SGD dampening != 0: the "
                             "captured step always takes the 'momentum buffer exists' branch, so the "
                             "first step would differ from eager PyTorch. Use cuda_graph=False.")


class TrainStep:
    """Callable ``step(inputs, targets) -> loss`` running one optimizer step; see :func:`train_step`."""

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 example_batch: tuple, streams: int, cuda_graph: bool, scheduler: str,
                 max_graphs: int, warmup: int, compile: bool = False,
                 amp_dtype: torch.dtype | None = None,
                 grad_scaler: "torch.amp.GradScaler | None" = None,
                 compile_options: dict[str, Any] | None = None):
        inputs, _ = example_batch
        self.compile_options = dict(compile_options or {})
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.requested_streams = streams
        self.scheduler = scheduler
        self.compile = compile
        self.amp_dtype = amp_dtype
        self.max_graphs, self.warmup = max_graphs, warmup
        self._example = _as_tuple(inputs)  # plans for other stream counts are built from it
        self.modules: dict[int, nn.Module] = {}
        self.backends: dict[int, ConcurBackend] = {}  # with compile=True: what each backend compiled
        self._module(streams)
        on_cuda = any(t.is_cuda for t in tensors_in(inputs)) and torch.cuda.is_available()
        if cuda_graph and not on_cuda:
            warnings.warn("concur.train_step: no CUDA inputs, so the concurrent plan runs eagerly "
                          "in issue order (same results as the plain loop).", stacklevel=3)
        self.cuda_graph = cuda_graph and on_cuda
        # Under GradScaler a plain optimizer asks found_inf.item() on the host, which a graph
        # cannot capture; fused ones skip an overflowing step on the device.
        if self.cuda_graph and self.grad_scaler is not None and not compat.enable_device_side_amp_skip(optimizer):
            warnings.warn(f"concur.train_step: {type(optimizer).__name__} under GradScaler checks for "
                          "infinities on the host, which a CUDA graph cannot capture; running the "
                          "concurrent plan eagerly. Use SGD, Adam or AdamW (made fused=True "
                          "automatically) to keep the graph.", stacklevel=3)
            self.cuda_graph = False
        if self.cuda_graph:
            _check_optimizer(optimizer)
            _make_capturable(optimizer)
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.eager_shapes: set[tuple] = set()
        self._warned: set[str] = set()

    @property
    def module(self) -> nn.Module:
        """The concurrent module with the requested stream count."""
        return self.modules[self.requested_streams]

    def _module(self, streams: int) -> nn.Module:
        if streams not in self.modules:
            if self.compile:
                # dynamic=False: a new batch size gets its own static graph, as CUDA graphs need
                self.backends[streams] = backend(streams=streams, scheduler=self.scheduler,
                                                 **self.compile_options)
                self.modules[streams] = torch.compile(self.model, backend=self.backends[streams], dynamic=False)
            else:
                self.modules[streams] = api.optimize(self.model, self._example, streams=streams,
                                                     scheduler=self.scheduler)
        return self.modules[streams]

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    def _loss(self, module: nn.Module, inputs: tuple, targets: Any) -> torch.Tensor:
        """Forward and loss, under autocast when ``amp_dtype`` is set (backward runs outside it)."""
        if self.amp_dtype is None:
            return self.loss_fn(module(*inputs), targets)
        device = "cuda" if any(t.is_cuda for t in tensors_in(inputs)) else "cpu"
        # cache_enabled=False: autocast's weight-cast cache must not outlive a CUDA-graph capture
        with torch.autocast(device, dtype=self.amp_dtype, cache_enabled=False):
            return self.loss_fn(module(*inputs), targets)

    def eager_step(self, inputs: tuple, targets: Any, module: nn.Module | None = None) -> torch.Tensor:
        """One step without a graph: zero_grad, forward, loss, backward, optimizer.step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(self.module if module is None else module, inputs, targets)
        self._backward_and_step(loss)
        return loss.detach()

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        """``loss.backward(); optimizer.step()``, through the loss scaler when there is one."""
        if self.grad_scaler is None:
            loss.backward()
            self.optimizer.step()
            return
        self.grad_scaler.scale(loss).backward()
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        inputs = _as_tuple(inputs)
        if not self.cuda_graph:
            return self.eager_step(inputs, targets)
        key = _signature(inputs, targets)
        captured = self.graphs.get(key)
        if captured is None and key not in self.eager_shapes:
            captured = self._capture_with_fallback(inputs, targets, key)
        if captured is None:
            return self.eager_step(inputs, targets, self._module(1))
        self.graphs.move_to_end(key)
        for static, new in zip(tensors_in((captured.static_inputs, captured.static_targets)),
                               tensors_in((inputs, targets))):
            static.copy_(new, non_blocking=True)
        captured.graph.replay()
        # A clone: the static loss is overwritten by the next replay, and users keep losses.
        return captured.static_loss.detach().clone()

    def _capture_with_fallback(self, inputs: tuple, targets: Any, key: tuple) -> _Captured | None:
        attempts = [self.requested_streams] + ([1] if self.requested_streams > 1 else [])
        for streams in attempts:
            try:
                captured = self._capture(inputs, targets, streams)
            except Exception as exc:  # OOM or an op that cannot be captured
                self._warn_once(f"concur.train_step: capturing the step with {streams} stream(s) failed "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                                "falling back to " + ("1 stream." if streams > 1 else "eager execution."))
                torch.cuda.empty_cache()
                continue
            if len(self.graphs) >= self.max_graphs:
                evicted, _ = self.graphs.popitem(last=False)
                self._warn_once(f"concur.train_step: more than {self.max_graphs} input shapes; "
                                "evicting the least recently used captured graph.")
            self.graphs[key] = captured
            return captured
        self.eager_shapes.add(key)
        return None

    def _capture(self, inputs: tuple, targets: Any, streams: int) -> _Captured:
        module = self._module(streams)
        snapshot = _Snapshot(self.model, self.optimizer, self.grad_scaler)
        clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
        static_inputs = tuple(clone(x) for x in inputs)
        static_targets = clone(targets) if isinstance(targets, torch.Tensor) else \
            type(targets)(clone(t) for t in targets)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.eager_step(static_inputs, static_targets, module)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                loss = self._loss(module, static_inputs, static_targets)
                self._backward_and_step(loss)
            # Keep only the value: a loss with its autograd graph would keep the AccumulateGrad
            # nodes alive, bound to this capture's stream, and a later capture would reuse them.
            loss = loss.detach()
        finally:
            snapshot.restore()
            torch.cuda.synchronize()
        return _Captured(graph, static_inputs, static_targets, loss, streams)


def train_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, example_batch: tuple,
               streams: int | str = 4, cuda_graph: bool = True, *, compile: bool = False,
               amp_dtype: torch.dtype | None = None,
               grad_scaler: "torch.amp.GradScaler | None" = None, scheduler: str = "critical_path",
               max_graphs: int = 4, warmup: int = 3, compile_options: dict[str, Any] | None = None
               ) -> TrainStep:
    """Return ``step(inputs, targets) -> loss`` that trains ``model`` one step per call.

    ``example_batch`` is ``(inputs, targets)``; inputs are a tensor or a tuple
    of the model's positional inputs; ``loss_fn(model_output, targets)``
    returns a scalar. With CUDA and ``cuda_graph=True`` the step (forward with
    the concurrent plan, backward, optimizer step) is captured once per input
    shape and replayed; ``streams=1`` is the serial baseline through the same
    path. Without CUDA it runs eagerly in the plan's issue order.

    ``compile=True`` runs the model through ``torch.compile`` with the concur
    backend (:mod:`concur.backend`): inductor's fused kernels on the streams,
    forward and backward, still captured whole; ``streams=1`` is then exactly
    ``torch.compile`` plus a whole-step CUDA graph. ``compile_options`` are
    more keyword arguments of :func:`concur.backend` (e.g.
    ``event_delay_launches``).

    ``streams="auto"`` on CUDA measures stream counts and schedulers with the
    tuner (:mod:`concur.tuner`, cached on disk, at most ~20 s) for the
    unfused path; with ``compile=True``, where each trial would recompile, and
    without CUDA, it takes the fewest streams predicted to reach 97% of the
    best predicted speedup.

    ``amp_dtype=torch.bfloat16`` runs forward and loss under autocast (the
    same as ``with torch.autocast(...)`` around them in a plain loop).
    For fp16 pass ``amp_dtype=torch.float16`` and a ``torch.amp.GradScaler``:
    each step is then ``scaler.scale(loss).backward(); scaler.step(opt);
    scaler.update()``, as in PyTorch's AMP recipe. Inside a CUDA graph the
    skip of an overflowing step happens on the device: SGD, Adam and AdamW
    are switched to their fused implementations, which support that; other
    optimizers run eagerly with a warning.
    """
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if not (isinstance(example_batch, (tuple, list)) and len(example_batch) == 2):
        raise TypeError("example_batch must be a pair (inputs, targets)")
    if streams == "auto":
        streams, scheduler, cuda_graph = _auto_configuration(
            model, loss_fn, optimizer, tuple(example_batch), scheduler, cuda_graph, compile, amp_dtype)
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams must be a positive int or 'auto', got {streams!r}")
    if compile_options and not compile:
        raise ValueError("compile_options are options of the torch.compile backend: pass compile=True too")
    return TrainStep(model, loss_fn, optimizer, tuple(example_batch), streams, cuda_graph, scheduler,
                     max_graphs, warmup, compile, amp_dtype, grad_scaler, compile_options)


def _auto_configuration(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                        example_batch: tuple, scheduler: str, cuda_graph: bool, compile: bool,
                        amp_dtype: torch.dtype | None = None) -> tuple[int, str, bool]:
    """Return (streams, scheduler, cuda_graph) for ``streams="auto"``: measured where affordable.

    The trials run in the step's precision (bf16 kernels are shorter and leave
    more room for streams); a GradScaler is left out of them: it changes no
    kernel that matters for timing, and trials must not move the user's scale.
    """
    on_cuda = any(t.is_cuda for t in tensors_in(example_batch[0])) and torch.cuda.is_available()
    if on_cuda and not compile:
        from .tuner import tune_train_step

        kwargs = {} if amp_dtype is None else {"amp_dtype": amp_dtype}
        chosen = tune_train_step(model, loss_fn, optimizer, example_batch, **kwargs).config
        return chosen.streams, chosen.scheduler, cuda_graph and chosen.cuda_graph
    return _predicted_stream_count(model, _as_tuple(example_batch[0]), scheduler), scheduler, cuda_graph


def _predicted_stream_count(model: nn.Module, inputs: tuple, scheduler: str) -> int:
    """Fewest streams reaching 97% of the best predicted speedup of the unfused plan."""
    speedups = api.inspect(model, inputs, scheduler=scheduler).predicted_speedup
    best = max(speedups.values())
    return min(k for k, v in speedups.items() if v >= 0.97 * best)

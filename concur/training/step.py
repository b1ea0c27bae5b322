"""One training step (forward, loss, backward, optimizer step) as a replayed CUDA graph with streams inside.

At small batches eager PyTorch is bound by the CPU launching kernels, and
streams in eager mode only add launch work. Inside a captured CUDA graph the
launches cost nothing at replay, so the concurrency of the plan shows. Hence
the whole step is captured once per input shape and replayed.

Capture needs warm-up iterations (cuBLAS/cuDNN handles, optimizer state,
autograd's lazy buffers) and those *train*. So model parameters, buffers,
gradients and optimizer state are snapshotted before warm-up and restored
after capture, in place (the graph keeps the same addresses): the first
replay is then exactly the user's first step. A failed capture restores the
snapshot too, then falls back to fewer streams and finally to eager
execution, with one warning each.

A replay reruns the kernels of its capture with the arguments of its
capture, so whatever the step reads from Python is frozen in it:

- Hyperparameters. For SGD, Adam and AdamW the captured update reads them
  from device tensors written from the param groups before each replay
  (:mod:`concur.training.captured_optim`), so every ``lr_scheduler`` works on the
  user's plain floats. Other optimizers, and fused ones stepped by a
  GradScaler, keep their own ``step()``; their graphs are keyed on the
  hyperparameter values, so a new value is a new capture (warned once).
- Everything else the trace depends on is fingerprinted on every call and is
  part of the graph's key: the train/eval flag of every module, the
  ``requires_grad`` of every parameter, the module tree (counted through
  torch's module/parameter/buffer registration hooks, so it is walked again
  only after a registration somewhere), the param groups and
  ``optimizer.load_state_dict`` calls. A change gives a new capture (LRU
  cache), never a replay of a stale graph. ``model.load_state_dict`` copies
  in place and needs none.
- Gradients live in buffers owned by the step, allocated outside the graphs
  for the parameters the probe backward reaches, so graphs for different
  shapes and for the positions of a gradient-accumulation cycle all
  accumulate into the same tensors, and ``p.grad`` shows them after a call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from concur import _torch_compat as compat
from concur.dag.annotate import tensors_in
from concur.fx import module as api
from concur.inductor.backend import ConcurBackend, backend
from concur.training import captured_optim

BeforeStep = Callable[[nn.Module, torch.optim.Optimizer], Any]

log = logging.getLogger("concur")

# torch maps a priority beyond the device's range to its highest (CUDA: lower numbers run first).
HIGHEST_PRIORITY = -100


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _signature(inputs: tuple, targets: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype, str(t.device)) for t in tensors_in((inputs, targets)))


_REGISTRATIONS = [0]  # module, parameter and buffer registrations anywhere since import


def _count_registration(*args: Any) -> None:
    _REGISTRATIONS[0] += 1


@functools.cache
def _watch_registrations() -> None:
    """Count assignments of submodules, parameters and buffers (torch's global registration hooks).

    Walking a 240-module model costs ~0.6 ms, reading its flags from a kept
    list ~0.05 ms: the tree is walked again only after the count moved.
    """
    from torch.nn.modules import module as module_mod

    for name in ("register_module_module_registration_hook", "register_module_parameter_registration_hook",
                 "register_module_buffer_registration_hook"):
        getattr(module_mod, name)(_count_registration)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph, or the CPU tests' emulation
    static_inputs: tuple
    static_targets: Any
    static_loss: torch.Tensor
    streams: int
    grads: dict = field(default_factory=dict)  # parameter -> the gradient buffer the graph accumulates into


class _Snapshot:
    """Copies of parameters, buffers, gradients, optimizer, loss-scaler and RNG state, restorable in place.

    The RNG state matters for dropout: warm-up draws masks, and without the
    restore the first replay would draw different masks than the user's first
    eager step, so the same seed would not give the same run. The loss scale
    matters for fp16: warm-up steps may back it off or grow it. Gradients are
    restored into the same tensor objects: graphs accumulate into them.
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
        self.grads = {p: (None if p.grad is None else (p.grad, p.grad.detach().clone())) for p in model.parameters()}
        self.state = {(p, k): v.detach().clone() for p, s in optimizer.state.items()
                      for k, v in s.items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def restore(self) -> None:
        for live, saved in self.tensors:
            live.copy_(saved)
        for p, g in self.grads.items():
            if g is not None:
                g[0].copy_(g[1])
            p.grad = None if g is None else g[0]
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


class _CudaGraphs:
    """Capture and replay with ``torch.cuda.CUDAGraph``; warm-up on a side stream, as torch's docs prescribe.

    With ``priority`` the step is captured on a stream of the highest
    priority. Stream 0 of every plan is the stream it is called on, and the
    critical-path scheduler keeps the longest path there, so that path's
    kernels (and the graph keeps each kernel's priority) win SMs over the side
    streams', which have the default, lowest priority.
    """

    def __init__(self, priority: bool):
        self.priority = priority
        self._capture_stream: torch.cuda.Stream | None = None

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, body: Callable[[], torch.Tensor], step: "TrainStep") -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        if self.priority and self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(priority=HIGHEST_PRIORITY)
        with torch.cuda.graph(graph, stream=self._capture_stream):
            out = body()
        return graph, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def failed(self) -> None:
        torch.cuda.empty_cache()


def _graph_runner(on_cuda: bool, priority: bool) -> _CudaGraphs | None:
    """The capture machinery for these inputs: CUDA graphs, or None (eager). CPU tests swap in an emulation."""
    return _CudaGraphs(priority) if on_cuda else None


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Set ``capturable=True`` where the optimizer has it (NAdam, RAdam, ...), moving step counters."""
    for group in optimizer.param_groups:
        if not all(p.is_cuda for p in group["params"]):  # capturable asserts CUDA (the CPU tests emulate graphs)
            continue
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


def _hashable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))  # read by the kernels where it lives, not baked as a float
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


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
        self._arguments = (model, loss_fn, optimizer, example_batch, streams, cuda_graph, scheduler, max_graphs,
                           warmup, compile, amp_dtype, grad_scaler, compile_options, accumulate, before_step,
                           stream_priority, split_weight_grads)
        self.stream_priority = stream_priority
        inputs, _ = example_batch
        self.compile_options = dict(compile_options or {})
        self.split_weight_grads = _split_option(split_weight_grads, self.compile_options, compile, cuda_graph)
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.requested_streams = streams
        self.scheduler = scheduler
        self.compile = compile
        self.amp_dtype = amp_dtype
        self.max_graphs, self.warmup = max_graphs, warmup
        self.accumulate, self.before_step = accumulate, before_step
        self.micro = 0  # position of the next call in the accumulation cycle
        self._example = _as_tuple(inputs)  # plans for other stream counts are built from it
        self.modules: dict[int, nn.Module] = {}
        self.backends: dict[int, ConcurBackend] = {}  # with compile=True: what each backend compiled
        self._module(streams)
        on_cuda = any(t.is_cuda for t in tensors_in(inputs)) and torch.cuda.is_available()
        self._runner = _graph_runner(on_cuda, stream_priority) if cuda_graph else None
        if cuda_graph and self._runner is None:
            warnings.warn("concur.train_step: no CUDA inputs, so the concurrent plan runs eagerly "
                          "in issue order (same results as the plain loop).", stacklevel=3)
        self.cuda_graph = self._runner is not None
        # Under GradScaler a plain optimizer asks found_inf.item() on the host, which a graph
        # cannot capture; fused ones skip an overflowing step on the device.
        if self.cuda_graph and self.grad_scaler is not None and not compat.enable_device_side_amp_skip(optimizer):
            warnings.warn(f"concur.train_step: {type(optimizer).__name__} under GradScaler checks for "
                          "infinities on the host, which a CUDA graph cannot capture; running the "
                          "concurrent plan eagerly. Use SGD, Adam or AdamW (made fused=True "
                          "automatically) to keep the graph.", stacklevel=3)
            self.cuda_graph, self._runner = False, None
        self._loads = [0]  # optimizer.load_state_dict calls
        self._hyper: captured_optim.DeviceHyperparameters | None = None
        self._baked_reason = ""  # why hyperparameters are baked into graphs (and keyed on), if they are
        if self.cuda_graph:
            _check_optimizer(optimizer)
            reason = "it is stepped by a GradScaler" if self.grad_scaler is not None else \
                captured_optim.unsupported_reason(optimizer)
            if reason is None:
                self._hyper = captured_optim.DeviceHyperparameters(optimizer)
            else:
                self._baked_reason = reason
                _make_capturable(optimizer)
            loads = self._loads
            optimizer.register_load_state_dict_post_hook(lambda opt: loads.__setitem__(0, loads[0] + 1))
        _watch_registrations()
        self._registrations = _REGISTRATIONS[0]
        self._tree = self._walk()
        self._tree_version = 0
        self._grad_buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._bound: _Captured | None = None
        self._last_baked: tuple | None = None
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.eager_keys: set[tuple] = set()
        self._warned: set[str] = set()

    def __getstate__(self) -> dict:
        """What a saved step keeps: its arguments (model, optimizer, ...) and its place in the accumulation cycle.

        Captured graphs, compiled modules, streams and device-side hyperparameters belong to one
        process and device, and none of them can be pickled; a loaded step builds them again from
        its arguments, as a new ``train_step`` would (its first call captures).
        """
        return {"arguments": self._arguments, "micro": self.micro}

    def __setstate__(self, state: dict) -> None:
        with warnings.catch_warnings():  # the saved step warned about its setup already
            warnings.simplefilter("ignore")
            self.__init__(*state["arguments"])
        self.micro = state["micro"]

    @property
    def module(self) -> nn.Module:
        """The concurrent module with the requested stream count."""
        return self._module(self.requested_streams)

    def _module(self, streams: int) -> nn.Module:
        if streams not in self.modules:
            if self.compile:
                # dynamic=False: a new batch size gets its own static graph, as CUDA graphs need
                self.backends[streams] = backend(streams=streams, scheduler=self.scheduler,
                                                 **self.compile_options)
                self.modules[streams] = torch.compile(self.model, backend=self.backends[streams], dynamic=False)
            else:
                self.modules[streams] = api.optimize(self.model, self._example, streams=streams,
                                                     scheduler=self.scheduler,
                                                     split_weight_grads=self.split_weight_grads)
        return self.modules[streams]

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    # --- the work of one call, shared by the eager path, warm-up and capture -------------------

    def _loss(self, module: nn.Module, inputs: tuple, targets: Any) -> torch.Tensor:
        """Forward and loss, under autocast when ``amp_dtype`` is set (backward runs outside it)."""
        if self.amp_dtype is None:
            return self.loss_fn(module(*inputs), targets)
        device = "cuda" if any(t.is_cuda for t in tensors_in(inputs)) else "cpu"
        # cache_enabled=False: autocast's weight-cast cache must not outlive a CUDA-graph capture
        with torch.autocast(device, dtype=self.amp_dtype, cache_enabled=False):
            return self.loss_fn(module(*inputs), targets)

    def _backward(self, loss: torch.Tensor) -> None:
        """``(loss / k).backward()``, through the loss scaler when there is one."""
        if self.accumulate > 1:
            loss = loss / self.accumulate
        if self.grad_scaler is None:
            loss.backward()
        else:
            self.grad_scaler.scale(loss).backward()

    def _update(self, optimizer_step: Callable[[], Any]) -> None:
        """``before_step(model, optimizer)`` then the optimizer step, as PyTorch's (AMP) recipe orders them."""
        if self.grad_scaler is None:
            if self.before_step is not None:
                self.before_step(self.model, self.optimizer)
            optimizer_step()
            return
        if self.before_step is not None:  # clipping needs true gradients: unscale first, as the AMP recipe does
            self.grad_scaler.unscale_(self.optimizer)
            self.before_step(self.model, self.optimizer)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def _eager(self, inputs: tuple, targets: Any, module: nn.Module, phase: tuple[bool, bool]) -> torch.Tensor:
        """One call without a graph: zero_grad (first of a cycle), forward, backward, update (last of a cycle)."""
        first, last = phase
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(module, inputs, targets)
        self._backward(loss)
        if last:
            self._update(self.optimizer.step)
        return loss.detach()

    def _micro_step(self, module: nn.Module, inputs: tuple, targets: Any, phase: tuple[bool, bool],
                    zero: list[torch.Tensor], optimizer_step: Callable[[], Any]) -> torch.Tensor:
        """The captured body: the eager call with gradients zeroed in place (their buffers are the graph's)."""
        first, last = phase
        if first and zero:
            torch._foreach_zero_(zero)
        loss = self._loss(module, inputs, targets)
        self._backward(loss)
        if last:
            self._update(optimizer_step)
        # Keep only the value: a loss with its autograd graph would keep the AccumulateGrad
        # nodes alive, bound to this capture's stream, and a later capture would reuse them.
        return loss.detach()

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        inputs = _as_tuple(inputs)
        self._check_tree()
        phase = self._phase()
        if self.cuda_graph:
            loss = self._graph_call(inputs, targets, phase)
        else:
            loss = self._eager(inputs, targets, self.module, phase)
        self.micro = (self.micro + 1) % self.accumulate
        return loss

    def _phase(self) -> tuple[bool, bool]:
        """(first, last): whether this call starts an accumulation cycle (zero gradients) and ends it (step)."""
        return self.micro == 0, self.micro == self.accumulate - 1

    # --- graphs --------------------------------------------------------------------------------

    def _walk(self) -> tuple:
        return tuple(self.model.modules()), tuple(self.model.parameters()), tuple(self.model.buffers())

    def _check_tree(self) -> None:
        """After a registration anywhere, walk the model again; if its tree changed, rebuild the plans.

        A plan traced before a submodule was replaced would still call the
        old one, so the concurrent modules are rebuilt from the new tree.
        """
        if self._registrations == _REGISTRATIONS[0]:
            return
        self._registrations = _REGISTRATIONS[0]
        tree = self._walk()
        if any(len(a) != len(b) or any(x is not y for x, y in zip(a, b)) for a, b in zip(tree, self._tree)):
            self._tree, self._tree_version = tree, self._tree_version + 1
            self.modules.clear()
            self.backends.clear()

    def _state_key(self) -> tuple:
        """What a captured step depends on besides input shapes, read on every call (~50 us at 240 modules).

        Parameter storages count too: ``model.to(...)`` or ``.half()`` after a capture keeps the
        parameter objects but gives them new memory, which a replayed graph would never read.
        """
        modules, params, _ = self._tree
        groups = self.optimizer.param_groups
        return (self._tree_version, self._loads[0],
                tuple([m.training for m in modules]), tuple([p.requires_grad for p in params]),
                tuple([p.data_ptr() for p in params]),
                tuple([(id(g["params"]), len(g["params"])) for g in groups]), self._hyperparameter_key())

    def _hyperparameter_key(self) -> tuple:
        if self._hyper is not None:  # values are refreshed before each replay; only the code's shape counts
            return captured_optim.structure(self.optimizer)
        return tuple(tuple((k, _hashable(v)) for k, v in g.items() if k != "params")
                     for g in self.optimizer.param_groups)

    def _graph_call(self, inputs: tuple, targets: Any, phase: tuple[bool, bool]) -> torch.Tensor:
        key = (_signature(inputs, targets), phase, self._state_key())
        captured = self.graphs.get(key)
        baked = self._hyperparameter_key() if self._hyper is None else None
        if captured is None and key not in self.eager_keys:
            self._warn_if_values_are_baked(baked)
            captured = self._capture_with_fallback(inputs, targets, key, phase)
        self._last_baked = baked
        if captured is None:
            return self._eager(inputs, targets, self._module(1), phase)
        self.graphs.move_to_end(key)
        if self._hyper is not None:
            self._hyper.refresh()
        if not phase[0]:
            self._gradients_into(captured)
        for static, new in zip(tensors_in((captured.static_inputs, captured.static_targets)),
                               tensors_in((inputs, targets))):
            static.copy_(new, non_blocking=True)
        captured.graph.replay()
        self._bind_gradients(captured)
        # A clone: the static loss is overwritten by the next replay, and users keep losses.
        return captured.static_loss.detach().clone()

    def _warn_if_values_are_baked(self, values: tuple) -> None:
        # Same groups, other values (a new group is a new layout, not a schedule).
        if self._hyper is None and self._last_baked is not None and len(values) == len(self._last_baked) \
                and values != self._last_baked:
            self._warn_once(f"concur.train_step: the hyperparameters of {type(self.optimizer).__name__} changed "
                            f"after capture; because {self._baked_reason}, its graphs hold the values of their "
                            "capture, so each new value is captured anew (warm-up and capture each time). For a "
                            "schedule that changes every step use SGD, Adam or AdamW without a GradScaler, whose "
                            "hyperparameters the graph reads from device tensors, or cuda_graph=False.")

    def _gradients_into(self, captured: _Captured) -> None:
        """Carry gradients accumulated outside this graph (eager calls, another cycle position) into its buffers.

        A ``zero_grad()`` between micro-batches leaves None: the graph then
        starts from zeros, as the plain loop would.
        """
        with torch.no_grad():
            for p, buf in captured.grads.items():
                g = p.grad
                if g is not buf:
                    buf.copy_(g) if g is not None else buf.zero_()

    def _bind_gradients(self, captured: _Captured) -> None:
        """Point each ``p.grad`` at the buffer this graph accumulated into, as the plain loop's ``.grad``."""
        first = next(iter(captured.grads.items()), None)
        if self._bound is captured and (first is None or first[0].grad is first[1]):
            return
        for p, buf in captured.grads.items():
            p.grad = buf
        self._bound = captured

    def _graph_limit(self) -> int:
        return self.max_graphs * min(self.accumulate, 3)  # first, middle and last position of a cycle

    def _capture_with_fallback(self, inputs: tuple, targets: Any, key: tuple,
                               phase: tuple[bool, bool]) -> _Captured | None:
        attempts = [self.requested_streams] + ([1] if self.requested_streams > 1 else [])
        for streams in attempts:
            try:
                captured = self._capture(inputs, targets, streams, phase)
            except Exception as exc:  # OOM or an op that cannot be captured
                self._warn_once(f"concur.train_step: capturing the step with {streams} stream(s) failed "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                                "falling back to " + ("1 stream." if streams > 1 else "eager execution."))
                self._runner.failed()
                continue
            if len(self.graphs) >= self._graph_limit():
                self.graphs.popitem(last=False)
                self._warn_once(f"concur.train_step: more than {self._graph_limit()} captured graphs (input "
                                "shapes, cycle positions, train/eval or frozen states); evicting the least "
                                "recently used.")
            self.graphs[key] = captured
            return captured
        self.eager_keys.add(key)
        return None

    def _gradient_buffer(self, p: torch.Tensor) -> torch.Tensor:
        buf = self._grad_buffers.get(p)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = self._grad_buffers[p] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return buf

    def _parameters_with_gradients(self, module: nn.Module, inputs: tuple, targets: Any) -> list[torch.Tensor]:
        """The parameters one backward reaches (the plain loop's non-None ``.grad``): a probe, undone by the snapshot."""
        params = list(self.model.parameters())
        for p in params:
            p.grad = None
        self._loss(module, inputs, targets).backward()
        reached = [p for p in params if p.grad is not None]
        for p in reached:
            p.grad = None
        return reached

    def _capture(self, inputs: tuple, targets: Any, streams: int, phase: tuple[bool, bool]) -> _Captured:
        module = self._module(streams)
        runner = self._runner
        snapshot = _Snapshot(self.model, self.optimizer, self.grad_scaler)
        clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
        static_inputs = tuple(clone(x) for x in inputs)
        static_targets = clone(targets) if isinstance(targets, torch.Tensor) else \
            type(targets)(clone(t) for t in targets)
        try:
            with runner.side_stream():
                reached = self._parameters_with_gradients(module, static_inputs, static_targets)
            # Allocated on the caller's stream, outside every graph: all graphs share them.
            grads = {p: self._gradient_buffer(p) for p in reached}
            for p, buf in grads.items():
                p.grad = buf
            optimized = [grads[p] for g in self.optimizer.param_groups for p in g["params"] if p in grads]
            body = functools.partial(self._micro_step, module, static_inputs, static_targets, phase, optimized,
                                     self._captured_optimizer_step(grads))
            with runner.side_stream():
                for _ in range(self.warmup):
                    body()
            graph, loss = runner.capture(body, self)
        finally:
            snapshot.restore()
            runner.synchronize()
        return _Captured(graph, static_inputs, static_targets, loss, streams, grads)

    def _captured_optimizer_step(self, grads: dict[torch.Tensor, torch.Tensor]) -> Callable[[], Any]:
        """The update the graph captures: the device-tensor one for SGD/Adam/AdamW, else ``optimizer.step``."""
        if self._hyper is None:
            return self.optimizer.step
        self._hyper.sync_groups()
        compat.note_optimizer_stepped(self.optimizer)
        return captured_optim.build_update(self.optimizer, self._hyper, grads)


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
    the path's (on the H100 0.1-3.4% faster fused steps, never slower:
    experiments/RESULTS.md). ``False`` captures on an ordinary stream.

    ``compile=True`` runs the model through ``torch.compile`` with the concur
    backend (:mod:`concur.inductor.backend`): inductor's fused kernels on the streams,
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

    ``streams="auto"`` on CUDA measures stream counts and schedulers with the
    tuner (:mod:`concur.observe.tuner`, cached on disk, at most ~20 s) and
    never keeps a configuration not measured faster than the serial graph.
    With ``compile=True`` every trial compiles, so it climbs 1, 2, ... up to
    4 streams with the given scheduler and stops at the first that is not
    faster (minutes for a large model, once: the result is cached). Without
    CUDA it takes the fewest streams predicted to reach 97% of the best
    predicted speedup.

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
    """
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if not (isinstance(example_batch, (tuple, list)) and len(example_batch) == 2):
        raise TypeError("example_batch must be a pair (inputs, targets)")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int (micro-batches per optimizer step), got {accumulate!r}")
    if before_step is not None and not callable(before_step):
        raise TypeError(f"before_step must be callable as before_step(model, optimizer), got {before_step!r}")
    if streams == "auto":
        streams, scheduler, cuda_graph = _auto_configuration(
            model, loss_fn, optimizer, tuple(example_batch), scheduler, cuda_graph, compile, amp_dtype,
            compile_options)
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams must be a positive int or 'auto', got {streams!r}")
    if compile_options and not compile:
        raise ValueError("compile_options are options of the torch.compile backend: pass compile=True too")
    return TrainStep(model, loss_fn, optimizer, tuple(example_batch), streams, cuda_graph, scheduler,
                     max_graphs, warmup, compile, amp_dtype, grad_scaler, compile_options, accumulate, before_step,
                     stream_priority, split_weight_grads)


def _split_option(split_weight_grads: bool | None, compile_options: dict[str, Any], compile: bool,
                  cuda_graph: bool) -> bool:
    """Return whether weight gradients are split: the argument, else ``compile_options``' value, else the default.

    The default is True except for an unfused step run eagerly, which would pay the split's host time each step.

    On the fused path the argument goes into ``compile_options``, as the backend's option of that name.
    """
    given = compile_options.get("split_weight_grads")
    if split_weight_grads is not None and given is not None and bool(given) != split_weight_grads:
        raise ValueError(f"concur.train_step: split_weight_grads={split_weight_grads} contradicts "
                         f"compile_options['split_weight_grads']={given}; compile_options are options of the "
                         "torch.compile backend, and this one is an argument of train_step too: pass it once")
    default = compile or cuda_graph
    value = split_weight_grads if split_weight_grads is not None else (default if given is None else bool(given))
    if compile and given is None and split_weight_grads is not None:
        compile_options["split_weight_grads"] = value
    return value


def _auto_configuration(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                        example_batch: tuple, scheduler: str, cuda_graph: bool, compile: bool,
                        amp_dtype: torch.dtype | None = None,
                        compile_options: dict[str, Any] | None = None) -> tuple[int, str, bool]:
    """Return (streams, scheduler, cuda_graph) for ``streams="auto"``: measured on a GPU, predicted elsewhere.

    The trials run in the step's precision (bf16 kernels are shorter and leave
    more room for streams); a GradScaler is left out of them: it changes no
    kernel that matters for timing, and trials must not move the user's scale.
    With ``compile`` every trial compiles, so the climb tries the given
    scheduler only, up to :data:`_COMPILED_MAX_STREAMS` streams, and stops at
    the first stream count that is not measurably faster than the best so far.
    """
    on_cuda = any(t.is_cuda for t in tensors_in(example_batch[0])) and torch.cuda.is_available()
    if on_cuda:
        from concur.observe.tuner import tune_train_step

        kwargs: dict[str, Any] = {} if amp_dtype is None else {"amp_dtype": amp_dtype}
        if compile:
            kwargs.update(compile=True, schedulers=(scheduler,), max_streams=_COMPILED_MAX_STREAMS,
                          budget_s=_COMPILED_TUNE_BUDGET_S, probe_utilization=False)
            if compile_options:
                kwargs["compile_options"] = dict(compile_options)
        chosen = tune_train_step(model, loss_fn, optimizer, example_batch, make_step=train_step, **kwargs).config
        if chosen.streams == 1:
            log.info("concur.train_step: streams='auto' keeps one stream for %s: no configuration with more "
                     "streams was measured faster than the serial graph", type(model).__name__)
        return chosen.streams, chosen.scheduler, cuda_graph and chosen.cuda_graph
    streams = _predicted_stream_count(model, _as_tuple(example_batch[0]), scheduler)
    if streams == 1:
        log.info("concur.train_step: streams='auto' keeps one stream for %s: no plan with more streams is "
                 "predicted faster (kernels sharing the device)", type(model).__name__)
    return streams, scheduler, cuda_graph


# streams="auto" with compile=True: each trial compiles (inductor's cache serves the repeated graphs)
_COMPILED_MAX_STREAMS = 4
_COMPILED_TUNE_BUDGET_S = 600.0


def _predicted_stream_count(model: nn.Module, inputs: tuple, scheduler: str) -> int:
    """Fewest streams reaching 97% of the best predicted speedup of the unfused plan."""
    speedups = api.inspect(model, inputs, scheduler=scheduler).predicted_speedup
    best = max(speedups.values())
    return min(k for k, v in speedups.items() if v >= 0.97 * best)

"""A probe: an unfused plan's side-stream outputs allocated from the caller's stream, so the blocks they free in
backward serve the caller's stream again.

Under memory pressure an unfused multi-stream step runs out where one stream
fits: the activations a side stream's forward makes are freed by the backward
into blocks that only that stream may reuse (the caching allocator keys its
free blocks by stream), while the caller's stream needs new memory. This probe
makes the outputs of the forward's large ops on a side stream (convolutions on
cuDNN, batch norm, max and average pooling, concatenation) on the caller's
stream instead, through their ``out=`` variants, each marked as used by the
side stream (``record_stream``: during a capture the allocator reuses it once
the graph orders those uses first). A block the caller's stream hands out may
have been freed there by work still queued, so before each such output the
side stream waits for the caller's stream: correct, at the price of an order
the plan did not ask for.

That form (``outputs``) leaves the backward as it was: each node's backward
runs on the stream of its forward, and a side stream's gradients and
workspaces still come from its own blocks. The second form
(``backward-on-caller``) keeps torch's current stream the caller's through the
forward and launches each op on its side stream from below autograd, so
autograd records the caller's stream for every node: the forward runs its
branches side by side, the whole backward on the caller's stream, from one
free list.

Measured (RESULTS.md, "The next levers, probed"): the second form keeps 4
streams under 1.05x of the recipe's memory, GoogLeNet and Inception-v3 b64
at 1.10x and 1.08x its speed (since a stem keeps its weight gradient on the
caller's stream; before, that gradient's cuDNN workspace on the
weight-gradient stream did not fit). Under PyTorch's CUDA sanitizer both forms report
races the sanitizer cannot rule out: an output allocated on the caller's
stream (which it counts as a write there) and written on a side stream that
waited for the caller's only where the caller was given work since, and
``new_empty``'s read of its argument (no kernel; no longer called); the first form on
Inception-v3 stops inside torch there (an internal assert, then a crash).

Enabled in ``experiments/memory.py``'s concur children by ``CONCUR_PROBE_CALLER_OUTPUTS`` (``1`` or
``outputs``, or ``backward-on-caller``; the rows say ``caller_outputs``, what was moved and launched);
:func:`install` patches the plan's stream runtime for the process. Not part of concur: made part of it, its
private torch names (the dispatch mode, ``torch._C._select_conv_backend``) go behind ``concur._torch_compat``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ENV = "CONCUR_PROBE_CALLER_OUTPUTS"
COUNTS: collections.Counter = collections.Counter()  # outputs made on the caller's stream, by op; "kept": not


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
        and not t.is_contiguous() else torch.contiguous_format


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(v) for v in x)
    return x


class CallerOutputs(TorchDispatchMode):
    """While a side stream is current, the handled ops' outputs come from the caller's stream.

    With ``launch`` set (``backward-on-caller``), torch's current stream stays
    the caller's through the forward and every op is launched on ``launch``
    here, below autograd: autograd then records the caller's stream for every
    node, so the whole backward runs there, its allocations in one free list.
    """

    def __init__(self, caller: torch.cuda.Stream):
        super().__init__()
        self.caller = caller
        self.launch: torch.cuda.Stream | None = None  # backward-on-caller: the stream the plan's ops go on
        # what the caller's stream has been given since the fork (its ops, its waits), and how much of it each side
        # stream has waited for: a side stream already behind everything queued there needs no further wait
        self.issued = 0
        self.waited: dict = {}

    def empty(self, like_shape: torch.Size, dtype: torch.dtype, device: torch.device,
              fmt: torch.memory_format, side: torch.cuda.Stream) -> torch.Tensor:
        with torch.cuda.stream(self.caller):
            t = torch.empty(like_shape, dtype=dtype, device=device, memory_format=fmt)
        if self.waited.get(side, 0) != self.issued:  # the block may be one the caller's queued work frees
            side.wait_stream(self.caller)
            self.waited[side] = self.issued
        t.record_stream(side)
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        side = self.launch if self.launch is not None else torch.cuda.current_stream()
        if side == self.caller:
            self.issued += 1
            return func(*args, **kwargs)
        launch = None
        if handler is not None:
            try:
                launch = handler(self, args, kwargs, side)  # checks and allocations only; the launch is returned
            except Exception:  # noqa: BLE001 - a probe: any doubt, the op as it is
                launch = None
            COUNTS[str(func) if launch is not None else "kept " + str(func)] += 1
        if launch is None:
            launch = functools.partial(func, *args, **kwargs)
        if self.launch is None:
            return launch()
        COUNTS["launched on a side stream"] += 1
        with torch.cuda.stream(side):
            return launch()


def _convolution(mode: CallerOutputs, args: tuple, kwargs: dict, side: torch.cuda.Stream) -> Callable | None:
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    if kwargs or transposed or x.dim() != 4 or not x.is_cuda:
        return None
    backend = torch._C._select_conv_backend(x, w, bias, stride, padding, dilation, transposed, output_padding,
                                            groups, None)
    if backend != torch._C._ConvBackend.Cudnn:
        return None
    fmt = torch._C._conv_determine_backend_memory_format(x, w, backend)
    shape = aten.convolution.default(_meta(x), _meta(w), None, stride, padding, dilation, False, output_padding,
                                     groups).shape
    out = mode.empty(shape, x.dtype, x.device, fmt, side)
    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32)

    def launch() -> torch.Tensor:
        xc, wc = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)  # on the launching stream
        aten.cudnn_convolution.out(xc, wc, padding, stride, dilation, groups, *flags, out=out)
        if bias is not None:
            out.add_(bias.reshape(1, -1, 1, 1))
        return out
    return launch


def _batch_norm(mode: CallerOutputs, args: tuple, kwargs: dict, side: torch.cuda.Stream) -> Callable | None:
    x = args[0]
    if kwargs or not x.is_cuda:
        return None
    metas = aten._batch_norm_with_update.default(*_meta(args))
    out = mode.empty(x.shape, x.dtype, x.device, _memory_format(x), side)
    stats = [torch.empty(m.shape, dtype=m.dtype, device=x.device) for m in metas[1:]]  # small: the current stream

    def launch() -> tuple:
        return aten._batch_norm_with_update.out(*args, out=out, save_mean=stats[0], save_invstd=stats[1],
                                                reserve=stats[2])
    return launch


def _batch_norm_out(out_op: Any, names: tuple[str, ...], small: tuple[torch.dtype, ...]) -> Callable:
    """A handler for a batch norm whose ``out_op`` takes its output, then tensors the kernel sizes itself
    (statistics, cuDNN's reserve: small, made empty on the current stream), by ``names``."""
    def handler(mode: CallerOutputs, args: tuple, kwargs: dict, side: torch.cuda.Stream) -> Callable | None:
        x = args[0]
        if kwargs or not x.is_cuda:
            return None
        outs = [mode.empty(x.shape, x.dtype, x.device, _memory_format(x), side),
                *(torch.empty(0, dtype=dtype, device=x.device) for dtype in small)]  # new_empty reads x, says CSAN
        return lambda: out_op(*args, **dict(zip(names, outs)))
    return handler


def _max_pool(mode: CallerOutputs, args: tuple, kwargs: dict, side: torch.cuda.Stream) -> Callable | None:
    x = args[0]
    if kwargs or not x.is_cuda or x.dim() != 4:
        return None
    value, index = aten.max_pool2d_with_indices.default(_meta(x), *args[1:])
    fmt = _memory_format(x)
    out = mode.empty(value.shape, x.dtype, x.device, fmt, side)
    indices = mode.empty(index.shape, index.dtype, x.device, fmt, side)
    return lambda: aten.max_pool2d_with_indices.out(*args, out=out, indices=indices)


def _avg_pool(mode: CallerOutputs, args: tuple, kwargs: dict, side: torch.cuda.Stream) -> Callable | None:
    x = args[0]
    if kwargs or not x.is_cuda or x.dim() != 4:
        return None
    shape = aten.avg_pool2d.default(_meta(x), *args[1:]).shape
    out = mode.empty(shape, x.dtype, x.device, _memory_format(x), side)
    return lambda: aten.avg_pool2d.out(*args, out=out)


def _cat(mode: CallerOutputs, args: tuple, kwargs: dict, side: torch.cuda.Stream) -> Callable | None:
    tensors = args[0]
    if kwargs or not tensors or not all(t.is_cuda for t in tensors):
        return None
    formats = {_memory_format(t) for t in tensors}
    if len(formats) != 1:
        return None
    shape = aten.cat.default(_meta(list(tensors)), *args[1:]).shape
    out = mode.empty(shape, tensors[0].dtype, tensors[0].device, formats.pop(), side)
    return lambda: aten.cat.out(*args, out=out)


HANDLERS = {aten.convolution.default: _convolution, aten._batch_norm_with_update.default: _batch_norm,
            aten.cudnn_batch_norm.default: _batch_norm_out(aten.cudnn_batch_norm.out, ("out0", "out1", "out2", "out3"),
                                                           (torch.float32, torch.float32, torch.uint8)),
            aten.native_batch_norm.default: _batch_norm_out(aten.native_batch_norm.out,
                                                            ("out", "save_mean", "save_invstd"),
                                                            (torch.float32, torch.float32)),
            aten.max_pool2d_with_indices.default: _max_pool, aten.avg_pool2d.default: _avg_pool,
            aten.cat.default: _cat}


MODES = ("outputs", "backward-on-caller")  # the probe's two forms, by ENV's value: "1" is "outputs"


def form_asked() -> str:
    """The form :data:`ENV` asks for ("1" is "outputs")."""
    value = os.environ.get(ENV, "")
    return "outputs" if value == "1" else value


def install(form: str = "outputs") -> None:
    """Patch :class:`concur.streams.StreamRuntime` so that each plan's forward runs under :class:`CallerOutputs`;
    with ``form="backward-on-caller"``, torch's current stream stays the caller's and the mode launches the ops."""
    from concur import streams

    if form not in MODES:
        raise ValueError(f"form must be one of {MODES}, got {form!r}")
    runtime = streams.StreamRuntime
    names = ("fork", "join", "abort", "switch", "wait", "on_weight_grad_stream")
    originals = runtime.__dict__.get("_probe_originals") or {name: runtime.__dict__[name] for name in names}
    for name, original in originals.items():  # installed again (another form): from the runtime's own methods
        setattr(runtime, name, original)
    runtime._probe_originals = originals
    fork, join, abort, switch, wait = runtime.fork, runtime.join, runtime.abort, runtime.switch, runtime.wait
    weight_grad_stream = runtime.on_weight_grad_stream

    def forked(self: Any, *inputs: Any) -> None:
        fork(self, *inputs)
        if self.active and torch.is_grad_enabled():
            self._probe_mode = CallerOutputs(self._streams[0])
            self._probe_mode.__enter__()

    def leave(self: Any) -> None:
        mode = getattr(self, "_probe_mode", None)
        if mode is not None:
            self._probe_mode = None
            mode.__exit__(None, None, None)

    def joined(self: Any, *outputs: Any) -> None:
        leave(self)
        join(self, *outputs)

    def aborted(self: Any) -> None:
        leave(self)
        abort(self)

    def switched(self: Any, index: int) -> None:
        mode = getattr(self, "_probe_mode", None)
        if mode is None:
            switch(self, index)
            return
        self._current = index  # torch's current stream stays the caller's: autograd records it
        mode.launch = self._streams[index]

    def waited(self: Any, event: int) -> None:
        wait(self, event)
        mode = getattr(self, "_probe_mode", None)
        if mode is not None and self._current == 0:  # the caller's stream now also follows that event
            mode.issued += 1

    @contextlib.contextmanager
    def on_weight_grad_stream(self: Any) -> Any:
        with weight_grad_stream(self):
            yield
        if getattr(self, "_probe_mode", None) is not None:
            torch.cuda.set_stream(self._streams[0])

    runtime.fork, runtime.join, runtime.abort, runtime.wait = forked, joined, aborted, waited
    if form == "backward-on-caller":
        runtime.switch, runtime.on_weight_grad_stream = switched, on_weight_grad_stream

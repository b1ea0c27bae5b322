"""A plan's side-stream ops with their memory from the caller's stream, and its whole backward there.

An unfused multi-stream step runs out of memory under pressure where one
stream fits: the caching allocator gives a freed block back only to the
stream that allocated it, so the activations a side stream's forward makes,
freed by the backward, serve none of the caller's stream's allocations at the
step's peak (the start of backward). Under :class:`CallerMemory` torch's
current stream stays the caller's through the forward and each op of a side
stream is launched on that stream from below autograd (a dispatch mode):
autograd records the caller's stream for every node, so the whole backward
runs there, from one free list; and the forward's large outputs
(convolutions on cuDNN, batch norms on torch's kernel, max and average pooling,
concatenation)
are made on the caller's stream through the ops' ``out=`` variants, so the
saved activations are the caller's blocks too. What the side streams still
allocate themselves (workspaces, the outputs of other ops) is small.

A block the caller's stream hands out may have been freed there by work
still queued, so the side stream waits for the caller's stream before
writing an op's outputs, once per op. Waiting only where the caller's stream
was given work since the last wait also orders every use first, and measured
no faster (GoogLeNet b64 under 1.05x: 10.65 against 10.66 ms); but PyTorch's
CUDA sanitizer counts an allocation as a write on the caller's stream and
cannot see that order. The output is marked used by the side stream
(``record_stream``; in a CUDA-graph capture the allocator reuses it once the
graph orders that use first).

On the H200 (b64 under 1.05x the recipe's peak memory, where the plain
plans' side streams do not fit): GoogLeNet and Inception-v3 keep 4 streams,
1.11x and 1.08x the recipe's speed. Unlimited the plain program, its
backward on the side streams too, is faster (1.19x and 1.13x):
:mod:`concur.training.capture` takes this form only after that one ran out
of memory (``concur.training.rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY``, on
by default).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from concur import _torch_compat as compat

__all__ = ["CallerMemory", "available"]

aten = torch.ops.aten
_Mode: type = compat.dispatch_mode_base() or object


def available() -> bool:
    """Whether this torch has what :class:`CallerMemory` needs (its dispatch modes)."""
    return _Mode is not object


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
        and not t.is_contiguous() else torch.contiguous_format


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(v) for v in x)
    return x


class CallerMemory(_Mode):  # type: ignore[misc,valid-type]
    """While entered, ops run on :attr:`launch` (the plan's current stream), torch's current stream the caller's.

    ``moved`` counts the outputs made on the caller's stream, ``launched`` the
    ops launched on a side stream.
    """

    def __init__(self, caller: torch.cuda.Stream):
        super().__init__()
        self.caller = caller
        self.launch: torch.cuda.Stream | None = None  # None: the caller's
        self.moved = 0
        self.launched = 0

    def output(self, shape: torch.Size, dtype: torch.dtype, device: torch.device,
               fmt: torch.memory_format) -> torch.Tensor:
        """An output of the op about to be launched on :attr:`launch`, allocated on the caller's stream; the
        launch waits for the caller's stream first (:meth:`__torch_dispatch__`)."""
        with torch.cuda.stream(self.caller):
            t = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)
        t.record_stream(self.launch)
        self.moved += 1
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        side = self.launch
        if side is None or side == self.caller:
            return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        launch = None
        if handler is not None and not kwargs:
            moved = self.moved
            try:
                launch = handler(self, args)  # shapes and allocations only; the launch is returned
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                launch = None  # a call the handler cannot read runs as it is, its output the side stream's
            if self.moved != moved:  # after every output is allocated: a block the caller's queued work frees
                side.wait_stream(self.caller)
        self.launched += 1
        with torch.cuda.stream(side):
            return launch() if launch is not None else func(*args, **kwargs)


def _convolution(mode: CallerMemory, args: tuple) -> Callable[[], Any] | None:
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    if transposed or x.dim() != 4 or not x.is_cuda:
        return None
    fmt = compat.cudnn_convolution_format(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
    if fmt is None:
        return None
    shape = aten.convolution.default(_meta(x), _meta(w), None, stride, padding, dilation, False, output_padding,
                                     groups).shape
    out = mode.output(shape, x.dtype, x.device, fmt)
    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32)

    def launch() -> torch.Tensor:
        xc, wc = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)  # on the launching stream
        aten.cudnn_convolution.out(xc, wc, padding, stride, dilation, groups, *flags, out=out)
        if bias is not None:
            out.add_(bias.reshape(1, -1, 1, 1))
        return out
    return launch


def _native_batch_norm(mode: CallerMemory, args: tuple) -> Callable[[], Any] | None:
    """A batch norm on torch's own kernel (channels-last inputs in half precision, say): its output made on the
    caller's stream; its statistics (small) in the kernel's accumulation type, sized by the kernel.

    cuDNN's batch norm has no such handler: its ``out=`` variant gives its
    reserve back as a new tensor, which torch 2.11 cannot return through a
    dispatch mode (an internal assertion, memory corrupted); nor does
    ``_batch_norm_with_update``, whose kernel calls it where cuDNN serves the call.
    """
    x = args[0]
    if not x.is_cuda:
        return None
    out = mode.output(x.shape, x.dtype, x.device, _memory_format(x))
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    stats = [torch.empty(0, dtype=accumulate, device=x.device) for _ in range(2)]
    return lambda: aten.native_batch_norm.out(*args, out=out, save_mean=stats[0], save_invstd=stats[1])


def _max_pool(mode: CallerMemory, args: tuple) -> Callable[[], Any] | None:
    x = args[0]
    if not x.is_cuda or x.dim() != 4:
        return None
    value, index = aten.max_pool2d_with_indices.default(_meta(x), *args[1:])
    fmt = _memory_format(x)
    out = mode.output(value.shape, x.dtype, x.device, fmt)
    indices = mode.output(index.shape, index.dtype, x.device, fmt)
    return lambda: aten.max_pool2d_with_indices.out(*args, out=out, indices=indices)


def _avg_pool(mode: CallerMemory, args: tuple) -> Callable[[], Any] | None:
    x = args[0]
    if not x.is_cuda or x.dim() != 4:
        return None
    shape = aten.avg_pool2d.default(_meta(x), *args[1:]).shape
    out = mode.output(shape, x.dtype, x.device, _memory_format(x))
    return lambda: aten.avg_pool2d.out(*args, out=out)


def _cat(mode: CallerMemory, args: tuple) -> Callable[[], Any] | None:
    tensors = args[0]
    if not tensors or not all(t.is_cuda for t in tensors):
        return None
    formats = {_memory_format(t) for t in tensors}
    if len(formats) != 1:
        return None
    shape = aten.cat.default(_meta(list(tensors)), *args[1:]).shape
    out = mode.output(shape, tensors[0].dtype, tensors[0].device, formats.pop())
    return lambda: aten.cat.out(*args, out=out)


_HANDLERS: dict[Any, Callable[[CallerMemory, tuple], Callable[[], Any] | None]] = {
    aten.convolution.default: _convolution,
    aten.native_batch_norm.default: _native_batch_norm,
    aten.max_pool2d_with_indices.default: _max_pool,
    aten.avg_pool2d.default: _avg_pool,
    aten.cat.default: _cat,
}

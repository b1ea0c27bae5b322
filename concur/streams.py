"""Apply a plan's stream switches, events and waits on CUDA; do nothing on CPU.

The generated forward (see :mod:`concur.fx.codegen`) calls these methods as
graph nodes, so no Python loop interprets the plan at run time. Index 0 is
always the *caller's* current stream, so a serial plan changes nothing and
the result lands where the caller expects it.

Memory safety across streams: a tensor allocated on stream A and read on
stream B can be freed by Python while B's kernel is still queued; the caching
allocator would then hand the block to A's next allocation, which could
overwrite it under B's feet. concur calls ``Tensor.record_stream(B)`` on such
tensors (``keep``) instead of holding references until the join, because
(1) the allocator then delays reuse only until B's work at the time of the
free is done, so peak memory stays close to the serial plan's, and (2) the
same protection covers tensors that autograd saves for backward, which live
past the join. During a CUDA-graph capture the allocator by default holds
such blocks until the capture ends; concur's captures switch on its reuse of
them once the captured graph orders their readers first
(:func:`concur._torch_compat.capture_reuses_cross_stream_blocks`).

Saved activations on the caller's stream (``saved_on_caller``, off unless
``CONCUR_SAVED_ON_CALLER=1`` while it is measured): autograd saves most of a
training forward's outputs for backward, and those a side stream made stay
in that stream's blocks until backward frees them, where only that stream
may reuse them; at the start of backward the caller's stream then allocates
beside blocks it cannot use (on the H200, a 2-stream unfused GoogLeNet b64
held 678 MB so, free, when it ran out). With the option, a tensor autograd
saves while a side stream is current, made on that stream, is copied into a
block of the caller's stream once the caller has waited for it (its
``wait`` on that stream's event), on the caller's stream, right after the
caller's next event (so the copies run beside the side streams' next
branches, not before them), or at the join; the side stream's block goes
back to that stream for a later branch. Backward reads the copy, protected
with ``record_stream`` for the stream that reads it.

A plan that splits weight gradients off (:mod:`concur.fx.weight_grads`) has
one more stream, the weight-gradient stream. No kernel runs on it in forward:
it is current only while autograd records a weight-gradient node, so that
backward runs that node there. Autograd makes it wait for the gradient it
reads (an event from the producing stream, which also brings it into a CUDA
graph capture) and makes the stream that called ``backward`` wait for it at
the end of backward, before the optimizer (the engine's leaf streams).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from concur import _torch_compat as compat
from concur.dag.annotate import cuda_device_in, tensors_in

__all__ = ["side_streams", "weight_grad_stream", "StreamRuntime"]


# Side streams per device, shared by every plan: the caching allocator keeps a freed block for the stream it
# was allocated on, and cuBLAS a 32 MiB workspace per stream, so streams of their own for each plan (a
# forward's, a backward's, each candidate of streams="auto") would each hold blocks and a workspace that no
# other plan could reuse, inside a captured step's pool too. Plans run one after another (each joins all
# its side streams back into the caller's before the next forks), so sharing orders nothing they need apart.
_SIDE_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}
_WEIGHT_GRAD_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """Return the first ``count`` side streams of ``device``, made on first use and shared by every plan."""
    streams = _SIDE_STREAMS.setdefault(device, [])
    with torch.cuda.device(device):
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device))
    return streams[:count]


def weight_grad_stream(device: torch.device) -> torch.cuda.Stream:
    """Return ``device``'s weight-gradient stream, shared by every plan.

    Priority 0, the lowest: its kernels are never on the critical path, so they yield SMs.
    """
    if device not in _WEIGHT_GRAD_STREAMS:
        _WEIGHT_GRAD_STREAMS[device] = torch.cuda.Stream(device, priority=0)
    return _WEIGHT_GRAD_STREAMS[device]


class _Saved:
    """A tensor autograd saved that a side stream made, and whether it is now a copy on the caller's stream."""

    __slots__ = ("tensor", "source", "version", "moved")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.source, self.moved = tensor, weakref.ref(tensor), False
        self.version = compat.version_counter(tensor)


def _moves_free_blocks() -> bool:
    """Whether a side stream's block, read by the caller's copy, can serve the side stream again before backward:
    outside a CUDA-graph capture once the copy is done; inside one only where the allocator reuses such blocks
    (torch >= 2.9), else every such block is held to the capture's end and the copies would only add memory."""
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # no CUDA driver: nothing is captured
        capturing = False
    # a parameter's transpose must be told from a tensor a side stream made: it is never moved
    return compat.tensors_know_their_bases() and (not capturing or compat.captures_reuse_cross_stream_blocks())


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda


def _record(t: torch.Tensor, stream: Any) -> None:
    t.record_stream(stream)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class StreamRuntime:
    """Streams and events of one plan, bound lazily to the device of the first CUDA input.

    ``event_streams`` gives the stream each event is recorded on (with
    ``saved_on_caller``: which side stream's saved tensors a ``wait`` of the
    caller covers).
    """

    def __init__(self, num_streams: int, num_events: int, weight_grad_stream: bool = False,
                 saved_on_caller: bool = False, event_streams: Sequence[int] = ()):
        self.num_streams = num_streams
        self.num_events = num_events
        self.has_weight_grad_stream = weight_grad_stream
        self.saved_on_caller = saved_on_caller
        self.event_streams = tuple(event_streams)
        if saved_on_caller and len(self.event_streams) != num_events:
            raise ValueError(f"saved_on_caller needs the stream of each of the {num_events} events, "
                             f"got {len(self.event_streams)}")
        self.moved = 0  # saved tensors copied to the caller's stream, over the runtime's life
        self._hooks: Any = None  # the saved-tensor hooks, entered at fork, left at join
        self._pending: list[list[_Saved]] = []
        self._moved_upto: list[int] = []
        self._marks: dict[int, int] = {}
        self._foreign: set[int] = set()
        self._holders: dict[tuple, _Saved] = {}
        self._due: dict[int, int] = {}  # per side stream: saved tensors the caller has waited for, to move
        self.active = False
        self._device: torch.device | None = None
        self._side: list[torch.cuda.Stream] = []
        self._weight_grad: torch.cuda.Stream | None = None
        self._events: list[torch.cuda.Event] = []
        self._streams: list[torch.cuda.Stream] = []
        self._current = 0

    def _bind(self, device: torch.device) -> None:
        if self._device == device:
            return
        with torch.cuda.device(device):
            self._side = side_streams(device, self.num_streams - 1)
            self._events = [torch.cuda.Event() for _ in range(self.num_events)]
            self._join_events = [torch.cuda.Event() for _ in range(self.num_streams)]
            self._weight_grad = weight_grad_stream(device) if self.has_weight_grad_stream else None
        self._device = device

    def fork(self, *inputs: Any) -> None:
        """Start a call: make every side stream wait for the work already queued by the caller."""
        device = cuda_device_in(inputs)
        self.active = device is not None and self.num_streams > 1
        if not self.active:
            return
        self._bind(device)
        caller = torch.cuda.current_stream(device)
        self._streams = [caller, *self._side]
        self._current = 0
        fork_event = self._join_events[0]
        fork_event.record(caller)
        for s in self._side:
            s.wait_event(fork_event)
        if self.saved_on_caller and torch.is_grad_enabled() and _moves_free_blocks():
            self._pending = [[] for _ in self._streams]
            self._moved_upto = [0] * len(self._streams)
            self._marks, self._foreign, self._holders, self._due = {}, set(), {}, {}
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def switch(self, index: int) -> None:
        """Make stream ``index`` current: the following ops are queued on it."""
        if self.active:
            self._current = index
            if self._hooks is not None:
                self._foreign = set()
            torch.cuda.set_stream(self._streams[index])

    def record(self, event: int) -> None:
        """Record event ``event`` on the current stream, after the op just issued."""
        if self.active:
            self._events[event].record(self._streams[self._current])
            if self._hooks is not None:
                self._marks[event] = len(self._pending[self._current])
                if self._current == 0:  # after the event the side streams wait for: the copies run beside them
                    for stream, upto in sorted(self._due.items()):
                        self._move(stream, upto)
                    self._due = {}

    def wait(self, event: int) -> None:
        """Make the current stream wait for event ``event``."""
        if self.active:
            self._streams[self._current].wait_event(self._events[event])
            if self._hooks is not None and self._current == 0 and self.event_streams[event] != 0:
                stream = self.event_streams[event]
                self._due[stream] = max(self._due.get(stream, 0), self._marks.get(event, 0))

    def keep(self, *tensors: Any) -> None:
        """Protect tensors allocated on another stream from reuse while the current stream uses them."""
        if self.active:
            stream = self._streams[self._current]
            foreign = tensors_in(tensors)
            for t in foreign:
                if t.is_cuda:
                    t.record_stream(stream)
            if self._hooks is not None:  # what the next op reads from another stream is not its stream's to move
                self._foreign = {t.untyped_storage().data_ptr() for t in foreign}

    def join(self, *outputs: Any) -> None:
        """End a call: the caller's stream waits for every side stream and becomes current again."""
        if not self.active:
            return
        caller = self._streams[0]
        for s, ev in zip(self._side, self._join_events[1:]):
            ev.record(s)
            caller.wait_event(ev)
        torch.cuda.set_stream(caller)
        self._current = 0
        for t in tensors_in(outputs):
            if t.is_cuda:
                t.record_stream(caller)
        if self._hooks is not None:
            for stream in range(1, len(self._streams)):
                self._move(stream, len(self._pending[stream]))
            self._leave_hooks()

    def abort(self) -> None:
        """Restore the caller's stream after an exception mid-plan."""
        if self.active and self._streams:
            torch.cuda.set_stream(self._streams[0])
            self._current = 0
        self._leave_hooks()

    @contextlib.contextmanager
    def on_weight_grad_stream(self) -> Iterator[None]:
        """Make the weight-gradient stream current for the block (no-op on CPU or without one).

        Only autograd nodes are recorded in the block, no kernel: a node runs
        its backward on the stream that was current when it was recorded.
        """
        stream = self._weight_grad if self.active else None
        if stream is None:
            yield
            return
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(self._streams[self._current])

    def protect(self, value: Any, streams: tuple[int, ...]) -> None:
        """Protect the tensors in ``value`` from reuse until the given streams' queued work is done."""
        if self.active:
            for t in tensors_in(value):
                if t.is_cuda:
                    for index in streams:
                        t.record_stream(self._streams[index])

    # --- saved activations on the caller's stream -----------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        """Autograd saves ``t``: kept as it is where the caller's stream made it (or a parameter); else held to
        be moved: at once where the caller's op saves what a side stream made (it has waited for it); where a
        side stream's op saves what its stream made, after the caller's first event once it has waited for it."""
        base = compat.view_base(t)
        if not _on_device(t) or isinstance(base, nn.Parameter):  # a weight, or a view of one (a transpose)
            return t
        foreign = t.untyped_storage().data_ptr() in self._foreign  # read from another stream by this op
        if (self._current == 0) != foreign:
            return t  # the caller's own; or, on a side stream, another stream's: left where it is
        key = _storage_key(t)  # one tensor saved by several ops is moved once
        saved = self._holders.get(key)
        if saved is None or saved.source() is not t or saved.version != compat.version_counter(t):
            saved = self._holders[key] = _Saved(t)
            if self._current == 0:
                self._copy(saved)
            else:
                self._pending[self._current].append(saved)
        return saved

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        """Backward reads a saved tensor: the copy on the caller's stream, protected for the stream reading it."""
        if not isinstance(saved, _Saved):
            return saved
        t = saved.tensor
        version = compat.version_counter(t)
        if not saved.moved and version != saved.version:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: a tensor of shape {tuple(t.shape)} is at version {version}, "
                               f"saved at version {saved.version}")
        if saved.moved and _on_device(t):
            _record(t, torch.cuda.current_stream(t.device))
        return t

    def _move(self, stream: int, upto: int) -> None:
        """Copy the tensors saved on side stream ``stream`` up to ``upto`` into blocks of the caller's stream
        (current), on it; each original goes back to its stream once the caller's copy has read it."""
        for saved in self._pending[stream][self._moved_upto[stream]:upto]:
            if compat.version_counter(saved.tensor) == saved.version:  # else changed in place: backward raises
                self._copy(saved)
        self._moved_upto[stream] = max(self._moved_upto[stream], upto)

    def _copy(self, saved: _Saved) -> None:
        """Copy ``saved`` into a block of the caller's stream, on it (current); the original goes back to its
        stream once the copy has read it."""
        t = saved.tensor
        saved.tensor = t.clone(memory_format=torch.preserve_format)
        saved.moved = True
        _record(t, self._streams[0])
        self.moved += 1

    def _leave_hooks(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        self._pending, self._marks, self._foreign, self._holders, self._due = [], {}, set(), {}, {}


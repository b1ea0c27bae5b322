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
from typing import Any, Iterator

import torch

from concur.caller_memory import CallerMemory
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


class StreamRuntime:
    """Streams and events of one plan, bound lazily to the device of the first CUDA input."""

    def __init__(self, num_streams: int, num_events: int, weight_grad_stream: bool = False,
                 caller_memory: bool = False):
        self.num_streams = num_streams
        self.num_events = num_events
        self.has_weight_grad_stream = weight_grad_stream
        # the side streams' ops launched from below autograd, their memory and their backward the caller's
        # (concur.caller_memory); entered at a fork with grad mode on, left at the join
        self.caller_memory = caller_memory
        self._mode: Any = None
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
        self._leave_mode()  # an earlier call that neither joined nor aborted must not leave its mode on torch's stack
        device = cuda_device_in(inputs)
        self.active = device is not None and (self.num_streams > 1 or self.has_weight_grad_stream)
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
        if self.caller_memory and self._side and torch.is_grad_enabled():
            self._mode = CallerMemory(caller)
            self._mode.__enter__()

    def switch(self, index: int) -> None:
        """Make stream ``index`` current: the following ops are queued on it (with caller memory, launched there
        while torch's current stream stays the caller's, so that autograd records the caller's)."""
        if self.active:
            self._current = index
            if self._mode is not None:
                self._mode.launch = self._streams[index]
            else:
                torch.cuda.set_stream(self._streams[index])

    def record(self, event: int) -> None:
        """Record event ``event`` on the current stream, after the op just issued."""
        if self.active:
            self._events[event].record(self._streams[self._current])

    def wait(self, event: int) -> None:
        """Make the current stream wait for event ``event``."""
        if self.active:
            self._streams[self._current].wait_event(self._events[event])

    def keep(self, *tensors: Any) -> None:
        """Protect tensors allocated on another stream from reuse while the current stream uses them."""
        if self.active:
            stream = self._streams[self._current]
            for t in tensors_in(tensors):
                if t.is_cuda:
                    t.record_stream(stream)

    def join(self, *outputs: Any) -> None:
        """End a call: the caller's stream waits for every side stream and becomes current again."""
        if not self.active:
            return
        self._leave_mode()
        caller = self._back_on_caller()
        for t in tensors_in(outputs):
            if t.is_cuda:
                t.record_stream(caller)

    def abort(self) -> None:
        """Restore the caller's stream after an exception mid-plan, ordered after the side streams' queued work
        (what handles the exception reads on the caller's stream what they wrote: a module's buffers, say)."""
        self._leave_mode()
        if self.active and self._streams:
            try:
                self._back_on_caller()
            except RuntimeError:  # a capture the error invalidated refuses the events; it is given up, not waited on
                torch.cuda.set_stream(self._streams[0])
                self._current = 0

    def _back_on_caller(self) -> torch.cuda.Stream:
        """Make the caller's stream wait for every side stream's queued work and current again; return it."""
        caller = self._streams[0]
        for s, ev in zip(self._side, self._join_events[1:]):
            ev.record(s)
            caller.wait_event(ev)
        torch.cuda.set_stream(caller)
        self._current = 0
        return caller

    def _leave_mode(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

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
        finally:  # with caller memory, torch's current stream is the caller's whatever the plan's current one
            torch.cuda.set_stream(self._streams[0 if self._mode is not None else self._current])

    def protect(self, value: Any, streams: tuple[int, ...]) -> None:
        """Protect the tensors in ``value`` from reuse until the given streams' queued work is done."""
        if self.active:
            for t in tensors_in(value):
                if t.is_cuda:
                    for index in streams:
                        t.record_stream(self._streams[index])

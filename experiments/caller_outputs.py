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
weight-gradient stream did not fit). Under PyTorch's CUDA sanitizer the
second form, on concur's mode (a side stream waits for the caller's before
each op whose outputs were made there; no cuDNN batch norm moved, whose
``out=`` variant torch 2.11 cannot return through a dispatch mode), runs
clean on GoogLeNet and Inception-v3.

The second form is now concur's own (:mod:`concur.caller_memory`, a rung
that is off by default); the probe gives it to every plan of more than one
stream, and runs the first form on concur's mode. Enabled in
``experiments/memory.py``'s concur children by ``CONCUR_PROBE_CALLER_OUTPUTS``
(``1`` or ``outputs``, or ``backward-on-caller``; the rows say
``caller_outputs``, what was moved and launched); :func:`install` patches the
plans' stream runtime for the process.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import torch

from concur.caller_memory import CallerMemory

ENV = "CONCUR_PROBE_CALLER_OUTPUTS"
COUNTS: collections.Counter = collections.Counter()  # what the forwards moved to the caller's stream and launched


class CallerOutputs(CallerMemory):
    """concur's :class:`~concur.caller_memory.CallerMemory` in the probe's first form (``outputs``): each op runs
    on torch's current stream, the plan's side stream, as the plain plan runs it, its handled outputs still made
    on the caller's stream; each node's backward runs on the stream of its forward."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.launch = torch.cuda.current_stream()
        return super().__torch_dispatch__(func, types, args, kwargs)


MODES = ("outputs", "backward-on-caller")  # the probe's two forms, by ENV's value: "1" is "outputs"


def form_asked() -> str:
    """The form :data:`ENV` asks for ("1" is "outputs")."""
    value = os.environ.get(ENV, "")
    return "outputs" if value == "1" else value


def install(form: str = "outputs") -> None:
    """Patch :class:`concur.streams.StreamRuntime` for the process: ``backward-on-caller`` gives every plan of
    more than one stream concur's caller memory; ``outputs`` runs each plan's forward under
    :class:`CallerOutputs`, its streams switched as the plain plan switches them. Either adds to :data:`COUNTS`."""
    from concur import streams

    if form not in MODES:
        raise ValueError(f"form must be one of {MODES}, got {form!r}")
    runtime = streams.StreamRuntime
    names = ("__init__", "fork", "_leave_mode")
    originals = runtime.__dict__.get("_probe_originals") or {name: runtime.__dict__[name] for name in names}
    for name, original in originals.items():  # installed again (another form): from the runtime's own methods
        setattr(runtime, name, original)
    runtime._probe_originals = originals
    init, fork, leave = (originals[name] for name in names)

    def leave_counting(self: Any) -> None:
        probe, self._probe_mode = getattr(self, "_probe_mode", None), None
        for mode in (probe, self._mode):
            if isinstance(mode, CallerMemory):
                COUNTS["outputs made on the caller's stream"] += mode.moved
                COUNTS["ops launched on a side stream"] += mode.launched
        if probe is not None:
            probe.__exit__(None, None, None)
        leave(self)

    runtime._leave_mode = leave_counting
    if form == "backward-on-caller":
        def init_with_caller_memory(self: Any, num_streams: int, num_events: int, weight_grad_stream: bool = False,
                                    caller_memory: bool = False) -> None:
            init(self, num_streams, num_events, weight_grad_stream, caller_memory=num_streams > 1)
        runtime.__init__ = init_with_caller_memory
        return

    def forked(self: Any, *inputs: Any) -> None:
        fork(self, *inputs)
        if self.active and self._side and torch.is_grad_enabled():
            self._probe_mode = CallerOutputs(self._streams[0])  # left at the join or abort, with concur's own
            self._probe_mode.__enter__()

    runtime.fork = forked

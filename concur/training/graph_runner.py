"""Capture and replay of whole training steps with ``torch.cuda.CUDAGraph``, as torch's docs prescribe.

One runner serves all graphs of a step: its warm-up and capture run on one
side stream (so the cached blocks and cuBLAS workspaces of one serve the
next), and its graphs share one memory pool (``torch.cuda.graph(pool=...)``). Sharing is safe
because a step replays its graphs one at a time on one stream, and each
graph's outputs (loss, gradients) stay referenced by its ``Captured`` for as
long as the graph lives, so no later capture is handed their memory.

The programs setup times (each graph's candidates, the step with and without
its plans) are captured on the same stream but never in the step's pool:
each timing has a pool of its own, given back when it ends
(:func:`concur.dag.measure.replay_rounds`). In the step's pool, what the
candidates left there (the blocks of a dropped plan's side streams, a pool
grown to the largest candidate) would stay reserved for as long as the step
lives.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from concur import _torch_compat as compat
from concur.dag.annotate import tensors_in
from concur.dag.measure import alternating_replays, can_time, captures_into, capturing, settle_failed_captures
from concur.training.rungs import Rung

__all__ = ["Captured", "CudaGraphRunner", "EventTiming", "batch_tensors", "graph_runner"]

# torch maps a priority beyond the device's range to its highest (CUDA: lower numbers run first).
HIGHEST_PRIORITY = -100


@dataclass
class Captured:
    """One captured step: its graph, the static tensors it reads and writes, and the rung whose module it ran."""

    graph: Any  # torch.cuda.CUDAGraph, or the CPU tests' emulation
    static_inputs: tuple
    static_targets: Any
    static_loss: torch.Tensor
    streams: Rung  # the step's module of that rung ran it (its plan says on how many streams)
    grads: dict = field(default_factory=dict)  # parameter -> the gradient tensor the graph writes
    # the static inputs' and targets' tensors in order, each call's batch is copied into: made once here
    static_batch: list = field(init=False)

    def __post_init__(self) -> None:
        self.static_batch = batch_tensors(self.static_inputs, self.static_targets)


def batch_tensors(inputs: tuple, targets: Any) -> list[torch.Tensor]:
    """The batch's tensors in order; a plain tuple of tensors (the usual batch) without walking a tree."""
    if isinstance(targets, torch.Tensor) and all(isinstance(x, torch.Tensor) for x in inputs):
        return [*inputs, targets]
    return tensors_in((inputs, targets))


class CudaGraphRunner:
    """Warm-up, timing and capture on one side stream, graphs in one shared pool.

    One stream for all of it: the caching allocator keeps freed blocks per
    stream, and cuBLAS a workspace per handle and stream (32 MiB on an
    H100, held for the life of the process), so a warm-up stream beside a
    capture stream, as in PyTorch's recipe, holds a second set. With
    ``priority`` that stream has the highest priority. Stream 0 of every
    plan is the stream it is called on, and the critical-path scheduler
    keeps the longest path there, so that path's kernels (and the graph
    keeps each kernel's priority) win SMs over the side streams', which have
    the default, lowest priority.
    """

    def __init__(self, priority: bool):
        self.priority = priority
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None  # the step's graphs'
        self._old_pool_held = False  # a pool new_pool() left, not yet given back

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stream setup runs and captures on, made at first use."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(priority=HIGHEST_PRIORITY) if self.priority else torch.cuda.Stream()
        return self._stream

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """Run the block on :attr:`stream`; graphs timed in it (a compiled graph's first call) capture on it too."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream), captures_into(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def _pool_handle(self) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def capture(self, body: Callable[[], Any], step: object) -> tuple[Any, Any]:
        """Capture ``body`` into the step's pool (:func:`concur.dag.measure.capturing`); return the graph and
        what ``body`` returned. A capture that fails leaves nothing behind: later captures go to a new pool."""
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, self._pool_handle(), self.stream):
                out = body()
        except BaseException:
            self.new_pool()
            raise
        # What setup cached outside the pool (warm-up's activations on this stream, which nothing else
        # allocates on) would stay reserved for the life of the process: give it back once per capture.
        torch.cuda.empty_cache()
        return graph, out

    def timed_replay(self, graph: Any) -> "EventTiming":
        """Replay ``graph`` on the current stream between two CUDA events; read its time once they complete."""
        timing = EventTiming()
        timing.start.record()
        graph.replay()
        timing.end.record()
        return timing

    def new_pool(self) -> None:
        """Capture later graphs into a new pool; the old one goes back to the device at
        :meth:`release_old_pool`, once its graphs and their tensors are freed."""
        self._pool = None
        self._old_pool_held = True

    def release_old_pool(self) -> None:
        """Give the pool :meth:`new_pool` left back to the device, where there is one: before the next warm-up,
        whose activations would otherwise be allocated beside it (unfused GoogLeNet b8: setup's reserved peak
        988 MB, against 630 MB held by the old pool).

        The old pool's graphs may sit in reference cycles that have outlived
        the young generations a capture collects (a trial's programs, replayed
        over many calls): only a full collection frees them, and a pool goes
        back at ``empty_cache`` only once none of its graphs is alive."""
        if self._old_pool_held:
            self._old_pool_held = False
            _give_back_unreferenced()

    def empty_cache(self) -> None:
        """Give every cached block that no live tensor uses back to the device, once the queued work is done."""
        torch.cuda.empty_cache()

    def can_time(self, device: torch.device) -> bool:
        """Whether :meth:`time_programs` can time on ``device`` now (:func:`concur.dag.measure.can_time`)."""
        return can_time(device)

    def time_programs(self, one_stream: Callable[[], Any], streams: Callable[[], Any],
                      device: torch.device) -> list[tuple[float, float]]:
        """Return alternating rounds of two programs, each captured as this runner captures a step.

        Same stream as the step's capture, so the programs' side streams run
        below its priority, as in the step; a pool of the timing's own, given
        back when it ends.
        """
        with self.side_stream():
            return alternating_replays(one_stream, streams, device)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def failed(self) -> None:
        """After a failed attempt (trial, warm-up, capture): give back what it held, once nothing refers to it.

        Its tensors and graph may sit in reference cycles (a traceback's
        frames), which only the cyclic collector frees; then the blocks go
        back to the device, so the next, smaller attempt has the room.
        """
        settle_failed_captures()
        _give_back_unreferenced()


def _give_back_unreferenced() -> None:
    """Free what only reference cycles still hold (a full collection), then give every cached block that no live
    tensor or graph uses back to the device, once the queued work is done."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class EventTiming:
    """The GPU time of one replay, from a pair of CUDA events (:class:`concur.training.trial.ReplayTiming`)."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def done(self) -> bool:
        """Whether the replay has finished on the device (never waits)."""
        return self.end.query()

    def wait(self) -> None:
        """Wait until the replay has finished on the device."""
        self.end.synchronize()

    def ms(self) -> float:
        return self.start.elapsed_time(self.end)


def graph_runner(on_cuda: bool, priority: bool) -> CudaGraphRunner | None:
    """The capture machinery for these inputs: CUDA graphs, or None (eager). CPU tests swap in an emulation."""
    return CudaGraphRunner(priority) if on_cuda else None

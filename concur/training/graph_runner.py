"""Capture and replay of whole training steps with ``torch.cuda.CUDAGraph``, as torch's docs prescribe.

One runner serves all graphs of a step: its warm-up runs on one side
stream (so the cached blocks of one warm-up serve the next), and its graphs
share one memory pool (``torch.cuda.graph(pool=...)``). Sharing is safe
because a step replays its graphs one at a time on one stream, and each
graph's outputs (loss, gradients) stay referenced by its ``Captured`` for as
long as the graph lives, so no later capture is handed their memory.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from concur.dag.annotate import tensors_in
from concur.dag.measure import alternating_replays, can_time

# torch maps a priority beyond the device's range to its highest (CUDA: lower numbers run first).
HIGHEST_PRIORITY = -100


@dataclass
class Captured:
    """One captured step: its graph, the static tensors it reads and writes, and how many streams it runs on."""

    graph: Any  # torch.cuda.CUDAGraph, or the CPU tests' emulation
    static_inputs: tuple
    static_targets: Any
    static_loss: torch.Tensor
    streams: int
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
    """Warm-up on one side stream, capture into one shared pool.

    With ``priority`` the step is captured on a stream of the highest
    priority. Stream 0 of every plan is the stream it is called on, and the
    critical-path scheduler keeps the longest path there, so that path's
    kernels (and the graph keeps each kernel's priority) win SMs over the side
    streams', which have the default, lowest priority.
    """

    def __init__(self, priority: bool):
        self.priority = priority
        self._capture_stream: torch.cuda.Stream | None = None
        self._side: torch.cuda.Stream | None = None
        self._pool: Any = None
        self._held: list = []  # a timing graph that keeps the shared pool alive until the next capture

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            yield
        torch.cuda.current_stream().wait_stream(self._side)

    def _where(self) -> tuple[Any, torch.cuda.Stream | None]:
        """The shared pool and the capture stream (None: torch.cuda.graph's own), made at first use."""
        if self.priority and self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(priority=HIGHEST_PRIORITY)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool, self._capture_stream

    def capture(self, body: Callable[[], Any], step: object) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        pool, stream = self._where()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = body()
        self._held.clear()
        return graph, out

    def can_time(self, device: torch.device) -> bool:
        """Whether :meth:`time_programs` can time on ``device`` now (:func:`concur.dag.measure.can_time`)."""
        return can_time(device)

    def time_programs(self, one_stream: Callable[[], Any], streams: Callable[[], Any],
                      device: torch.device) -> list[tuple[float, float]]:
        """Return alternating rounds of two programs, each captured as this runner captures a step.

        Same pool and capture stream as the step (so the step's capture
        reuses what timing held, and the side streams run below the capture
        stream's priority, as in the step); warm-up on the warm-up stream.
        One timing graph is held until the next capture: torch refuses to
        capture into a pool whose graphs are all gone.
        """
        pool, stream = self._where()
        kept: list = []
        with self.side_stream():
            rounds = alternating_replays(one_stream, streams, device, warmup=1, pool=pool, capture_stream=stream,
                                         keep=kept)
        self._held = kept[:1]
        return rounds

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def failed(self) -> None:
        torch.cuda.empty_cache()


def graph_runner(on_cuda: bool, priority: bool) -> CudaGraphRunner | None:
    """The capture machinery for these inputs: CUDA graphs, or None (eager). CPU tests swap in an emulation."""
    return CudaGraphRunner(priority) if on_cuda else None

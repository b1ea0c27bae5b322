"""Time work with CUDA events (GPU) or the wall clock (CPU): warm-up first, then median and spread.

Each call is timed between two CUDA events on its stream, so no host
synchronize falls inside a timed interval (``torch.utils.benchmark.Timer``
reads the host clock around one); the statistics over those times are
``torch.utils.benchmark``'s :class:`~torch.utils.benchmark.Measurement`
(:func:`summarize`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

__all__ = [
    "cuda_times_ms",
    "cuda_block_ms",
    "wall_times_ms",
    "summarize",
    "median_and_iqr",
    "time_cuda_ms",
    "time_wall_ms",
]

if TYPE_CHECKING:
    from torch.utils.benchmark import Measurement


def cuda_times_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> list[float]:
    """Return the time of each of ``repeats`` calls of ``fn`` (ms, CUDA events), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_block_ms(fn: Callable[[], object], warmup: int = 2, steps: int = 20) -> float:
    """Return the mean time (ms) of ``steps`` back-to-back calls of ``fn`` between two CUDA events.

    A training loop that reads its loss only now and then queues steps ahead
    of the device, so the host's time per call hides behind the kernels;
    :func:`cuda_times_ms` waits after every call and counts it. Both are
    step times; this is the one of such a loop.
    """
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def wall_times_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> list[float]:
    """Return the wall-clock time of each of ``repeats`` calls of ``fn`` (ms), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return times


def summarize(times_ms: list[float], label: str = "") -> Measurement:
    """Return ``torch.utils.benchmark``'s Measurement of times taken one call each (ms, not its seconds).

    Its ``median`` and ``iqr`` (quartiles interpolated linearly, as numpy's
    default) are in the unit of the times given.
    """
    # Imported here: torch.utils.benchmark imports cpp_extension, which logs a warning on a machine without CUDA.
    from torch.utils.benchmark import Measurement, TaskSpec

    return Measurement(number_per_run=1, raw_times=list(times_ms), task_spec=TaskSpec(stmt=label, setup=""))


def median_and_iqr(times: list[float]) -> tuple[float, float]:
    """Return the median and the interquartile range of a list of times, in their unit."""
    m = summarize(times)
    return m.median, m.iqr


def time_cuda_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> tuple[float, float]:
    """Return the median and interquartile range (ms) of ``fn`` timed with CUDA events."""
    return median_and_iqr(cuda_times_ms(fn, warmup, repeats))


def time_wall_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> tuple[float, float]:
    """Return the median and interquartile range (ms) of ``fn`` timed with the wall clock (CPU runs)."""
    return median_and_iqr(wall_times_ms(fn, warmup, repeats))

"""Time work with CUDA events (GPU) or the wall clock (CPU): warm-up first, then median and spread."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


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


def median_and_iqr(times: list[float]) -> tuple[float, float]:
    """Return the median and the interquartile range of a list of times."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return statistics.median(times), q[2] - q[0]


def time_cuda_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> tuple[float, float]:
    """Return the median and interquartile range (ms) of ``fn`` timed with CUDA events."""
    return median_and_iqr(cuda_times_ms(fn, warmup, repeats))


def time_wall_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> tuple[float, float]:
    """Return the median and interquartile range (ms) of ``fn`` timed with the wall clock (CPU runs)."""
    return median_and_iqr(wall_times_ms(fn, warmup, repeats))

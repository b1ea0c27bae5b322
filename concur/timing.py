"""Time GPU work with CUDA events: warm-up first, then the median and spread of repeats."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_cuda_ms(fn: Callable[[], object], warmup: int = 5, repeats: int = 20) -> tuple[float, float]:
    """Return the median and interquartile range (ms) of ``fn`` timed with CUDA events."""
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
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]

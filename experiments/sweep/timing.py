"""The timed steps of a child: CUDA events after a warm-up (the wall clock on CPU), rounds in turns, NVML.

Each row gets the median step time and its interquartile range, both from
:mod:`concur.observe.timing`, and the GPU's utilization over the timed steps.
Modes timed in turns get their steady memory peaks here too, one stretch of
steps at a time (:mod:`experiments.sweep.memory`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from experiments.sweep.configs import file_stem
from experiments.sweep.memory import MemoryPeaks


@dataclass
class PreparedMode:
    """One mode of one configuration, set up (compiled or captured) and ready to step: what the timing steps.

    It lives beside the timing, which reads it, so that measure.py (which builds it) imports timing and not the
    other way round."""

    row: dict
    step_fn: Callable[[], None]
    train_step: Any  # concur's TrainStep, or None for the plain-loop and peer modes
    model: Any
    x: Any
    cuda: bool
    memory: MemoryPeaks = field(default_factory=lambda: MemoryPeaks(cuda=False))


def time_steps(row: dict, cfg: dict, fn: Callable[[], None], cuda: bool) -> None:
    """Time ``fn`` (the median of repeats after a warm-up) and fill the row's time and utilization."""
    from concur.observe.timing import time_cuda_ms, time_wall_ms

    warmup, repeats = cfg.get("warmup", 5), cfg.get("repeats", 30)
    if not cuda:
        row["ms"], row["iqr_ms"] = time_wall_ms(fn, warmup, repeats)
        row["util_percent"] = None
        return

    def timed() -> None:
        row["ms"], row["iqr_ms"] = time_cuda_ms(fn, warmup=warmup, repeats=repeats)
    # NVML reports a sample every ~200 ms: a timeline worth drawing needs seconds of steps
    _under_nvml(row, cfg, fn, cfg.get("util_seconds", 0.0), first=timed)


def time_in_turns(prepared: list[PreparedMode], cfg: dict) -> None:
    """Time the prepared modes in alternating rounds; each row gets its median, spread and utilization.

    On CUDA each round gives two samples per mode: the mean of ``repeats/rounds``
    back-to-back steps (``ms``: a loop that reads its loss now and then, where
    the host's time per call hides behind the device's) and, right after,
    the same number of steps each waited for (``synced_ms``: a loop that
    reads its loss every step, which adds the host's time before the
    replay). ``ms`` is the median over rounds, ``iqr_ms`` their spread.
    """
    from concur.observe.timing import cuda_block_ms, cuda_times_ms, median_and_iqr, wall_times_ms

    rounds = max(1, cfg.get("rounds", 5))
    per_round = max(1, cfg.get("repeats", 30) // rounds)
    rewarm = 2  # steps after switching modes: the other mode's kernels left the caches cold
    times: list[list[float]] = [[] for _ in prepared]
    synced: list[list[float]] = [[] for _ in prepared]
    for _ in range(rounds):
        for i, p in enumerate(prepared):
            p.memory.begin_steps()  # each mode's stretch: its steady peak is the largest rise over one
            if p.cuda:
                times[i].append(cuda_block_ms(p.step_fn, rewarm, per_round))
                synced[i] += cuda_times_ms(p.step_fn, 0, per_round)
            else:
                times[i] += wall_times_ms(p.step_fn, rewarm, per_round)
            p.memory.end_steps()
    for p, ts, ss in zip(prepared, times, synced):
        p.row["ms"], p.row["iqr_ms"] = median_and_iqr(ts)
        if ss:
            p.row["synced_ms"], p.row["synced_iqr_ms"] = median_and_iqr(ss)
        p.row["rounds"] = rounds
        p.memory.record_steady(p.row)
        if p.cuda:  # NVML samples every ~200 ms: each mode steps alone for a while for its utilization
            _under_nvml(p.row, cfg, p.step_fn, max(cfg.get("util_seconds", 0.0), 1.0))
        else:
            p.row["util_percent"] = None


def _under_nvml(row: dict, cfg: dict, fn: Callable[[], None], seconds: float,
                first: Callable[[], None] = lambda: None) -> None:
    """Run ``first``, then step ``fn`` until ``seconds`` have passed, under NVML; record the utilization."""
    import torch

    from concur.dag.nvml import nvml_index
    from concur.observe.monitor import Monitor

    monitor = Monitor(nvml_index()).start()
    monitor.mark("timed steps")
    t0 = time.monotonic()
    first()
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    record = monitor.stop()
    timed_s = record.phases()[-1][1] if record.marks else 0.0
    row["util_percent"] = record.mean_utilization(start_s=timed_s)
    row["timed_s"] = time.monotonic() - t0
    row["util_timeline"] = str(record.save(Path(cfg["out"]) / "util" / (file_stem(row["key"]) + ".json")))

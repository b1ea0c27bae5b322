"""concur.observe.timing: warm-up calls are not timed, torch's median and IQR, the CUDA path with fake events."""

from __future__ import annotations

import itertools

import pytest
import torch

from concur.observe import timing


def test_wall_times_skip_the_warm_up_and_time_each_repeat(monkeypatch):
    calls = []
    clock = itertools.count(step=0.002)  # every perf_counter() call advances 2 ms
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    times = timing.wall_times_ms(lambda: calls.append(1), warmup=3, repeats=4)
    assert len(calls) == 7 and times == pytest.approx([2.0] * 4)


def test_median_and_interquartile_range():
    # torch.utils.benchmark's quartiles, interpolated linearly: at positions 1 and 3 of 0..4 -> 2.0 and 4.0
    assert timing.median_and_iqr([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, 2.0)
    assert timing.median_and_iqr([4.0, 1.0, 3.0, 2.0]) == (2.5, 3.25 - 1.75)
    assert timing.median_and_iqr([5.0]) == (5.0, 0.0)


def test_the_statistics_are_torch_benchmarks_measurement_in_the_unit_given():
    from torch.utils.benchmark import Measurement

    m = timing.summarize([2.0, 4.0, 3.0], label="step")
    assert isinstance(m, Measurement) and m.task_spec.stmt == "step"
    assert (m.median, m.iqr, m.mean) == (3.0, 1.0, 3.0)  # milliseconds stay milliseconds: one call per time


def test_time_wall_ms_reports_the_median_of_real_work():
    median, iqr = timing.time_wall_ms(lambda: sum(range(1000)), warmup=1, repeats=5)
    assert 0 < median < 100 and iqr >= 0


def test_cuda_times_use_events_around_each_repeat(monkeypatch):
    elapsed = iter([3.0, 1.0, 2.0])

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return next(elapsed)

    calls = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    assert timing.time_cuda_ms(lambda: calls.append("step"), warmup=2, repeats=3) == (2.0, pytest.approx(1.0))
    assert calls == ["step", "step", "sync", "step", "step", "step"]  # warm-up, then one sync, then timed

"""experiments/memory_records.py: what a memory.py child records beyond peaks and times, on the CPU with the
allocator and CUDA faked: the breakdown by pool and stream, the allocations out of memory, a step's calls that
captured, and the profiles' tables."""

from __future__ import annotations

import types

import torch

from experiments import memory_records
from experiments.memory_records import MB


def test_a_row_counts_the_allocations_out_of_memory_those_recovered_from_too(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: {"num_ooms": 3, "num_alloc_retries": 5})
    assert memory_records.out_of_memory_count() == 3
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: {})  # no CUDA allocator started
    assert memory_records.out_of_memory_count() == 0

def test_the_breakdown_keeps_pools_and_streams_apart(monkeypatch):
    """A graph pool's side-stream blocks are what a multi-stream step adds: the breakdown must show them apart."""
    segments = [dict(segment_pool_id=(0, 0), stream=0, total_size=2 * MB, allocated_size=MB),
                dict(segment_pool_id=(0, 4), stream=77, total_size=10 * MB, allocated_size=4 * MB),
                dict(segment_pool_id=(0, 4), stream=77, total_size=6 * MB, allocated_size=0),
                dict(segment_pool_id=(0, 4), stream=91, total_size=3 * MB, allocated_size=3 * MB)]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert memory_records.breakdown() == {"default stream0": [2.0, 1.0], "pool0.4 stream1": [16.0, 4.0],
                                  "pool0.4 stream2": [3.0, 3.0]}

def test_top_kernels_are_the_n_longest_per_step_and_skip_host_only_events():
    from types import SimpleNamespace as E

    averages = [E(key="aten::conv", device_time_total=0.0, count=10),  # host-side: no device time of its own
                E(key="cudnn_sm90_conv_fprop", device_time_total=900.0, count=30),
                E(key="triton_poi_fused_relu", device_time_total=300.0, count=60),
                E(key="Memcpy HtoD", device_time_total=30.0, count=3)]
    top = memory_records.top_kernels(averages, steps=3, n=2)
    assert top == [dict(kernel="cudnn_sm90_conv_fprop", us_per_step=300.0, calls_per_step=10.0),
                   dict(kernel="triton_poi_fused_relu", us_per_step=100.0, calls_per_step=20.0)]
    older = [E(key="k", cuda_time_total=6.0, count=3)]  # torch that names it cuda_time_total
    assert memory_records.top_kernels(older, steps=3, n=5) == [dict(kernel="k", us_per_step=2.0, calls_per_step=1.0)]


class _Step:
    """A concur step stand-in: its second call captures (and a failure with it), the others replay."""

    def __init__(self):
        self.calls, self.failed_streams = 0, {4}
        self._trial = None
        self.deciding = False

    @property
    def status(self):
        captured = self.calls >= 2
        return types.SimpleNamespace(captures=int(captured), failures=int(captured), streams=2,
                                     fallbacks=["the step on 4 streams does not fit in memory"] if captured else [])

    def __call__(self, *batch):
        self.calls += 1
        return torch.tensor(float(self.calls))


def test_the_call_log_notes_only_the_calls_that_changed_the_captures_and_passes_the_rest_through():
    log: list = []
    step = memory_records.CallLog(_Step(), log)
    losses = [step("x") for _ in range(4)]
    assert [float(l) for l in losses] == [1.0, 2.0, 3.0, 4.0] and step.deciding is False  # attributes pass through
    (entry,) = log
    assert entry["call"] == 1 and (entry["captures"], entry["failures"], entry["streams"]) == (1, 1, 2)
    assert entry["failed_streams"] == ["4"] and entry["trial"] is None and "does not fit" in entry["fallback"]


def test_the_host_profile_names_the_functions_by_time_per_step_and_the_modes_left(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def slow_part():
        return sum(range(20000))

    def step():
        slow_part()

    profile = memory_records.profile_host(step, steps=4, n=10)
    assert profile["ms_per_step"] > 0 and profile["dispatch_modes"] == []
    named = {f["function"].split(" ", 1)[1]: f for f in profile["functions"]}
    assert named["slow_part"]["calls_per_step"] == 1.0
    assert named["step"]["ms_per_step"] >= named["slow_part"]["ms_per_step"]


def test_without_cuda_the_current_stream_is_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory_records.current_stream() is None

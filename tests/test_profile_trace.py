"""concur.observe.profile_trace: per-step kernels, overlap and streams from profiler traces; graph replays; hidden kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

from concur.observe.profile_trace import load_events, parse_events, parse_trace, profile_steps

FIXTURES = Path(__file__).parent / "fixtures"
SERIAL = FIXTURES / "run_small" / "traces" / "googlenet_b8_serial_graph.json.gz"
CONCURRENT = FIXTURES / "run_small" / "traces" / "googlenet_b8_concur_4_streams.json.gz"


def test_serial_graph_replay_trace_has_one_stream_and_no_overlap():
    s = parse_trace(SERIAL)
    assert s.streams == (7,) and s.graph_launches == 3 and not s.kernels_hidden
    assert [st.step for st in s.steps] == [0, 1, 2]
    for st in s.steps:  # 30 kernels of 20 us with 5 us gaps
        assert st.kernels == 30 and st.kernel_us == pytest.approx(600) and st.busy_us == pytest.approx(600)
        assert st.wall_us == pytest.approx(745) and st.overlap == pytest.approx(600 / 745)
        assert st.concurrency == pytest.approx(1.0)


def test_concurrent_trace_overlaps_four_streams():
    s = parse_trace(CONCURRENT)
    assert s.streams == (7, 20, 24, 28) and s.graph_launches == 0
    for st in s.steps:  # stem 100 + 4 x 300 in parallel + join 50 + memset 2
        assert st.kernels == 15 and st.streams == 4
        assert st.kernel_us == pytest.approx(1352) and st.wall_us == pytest.approx(452)
        assert st.busy_us == pytest.approx(452) and st.overlap == pytest.approx(1352 / 452)
    assert {k.category for k in s.kernels} == {"kernel", "gpu_memset"}


def test_graph_replays_without_kernels_are_reported_as_hidden():
    s = parse_trace(FIXTURES / "trace_graph_hidden.json")
    assert s.kernels_hidden and s.graph_launches == 3 and s.steps == () and s.mean("overlap") is None


def test_a_kernel_belongs_to_the_step_that_launched_it_not_the_one_running_on_the_cpu():
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 50, "dur": 2, "args": {"correlation": 1}},
        # runs on the GPU while the CPU is already in step 1
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 150, "dur": 10, "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "orphan", "ts": 150, "dur": 10, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#0", "ts": 0, "dur": 500},
    ]
    s = parse_events(events)
    assert {k.name: k.step for k in s.kernels} == {"late": 0, "orphan": 1}
    assert len(s.steps) == 2  # the GPU-side annotation is not a step


def test_a_trace_without_step_markers_is_one_step():
    events = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": i * 10, "dur": 10, "tid": 3} for i in range(4)]
    s = parse_events(events)
    assert len(s.steps) == 1 and s.steps[0].wall_us == 40 and s.streams == (3,)


def test_profile_steps_writes_a_gzipped_trace_with_step_markers(tmp_path):
    import torch

    x = torch.randn(16, 16)
    path = profile_steps(lambda: x @ x, tmp_path / "t.json.gz", active=2, warmup=1)
    names = {e.get("name", "") for e in load_events(path)}
    assert path.exists() and {"ProfilerStep#1", "ProfilerStep#2"} <= names
    assert not (tmp_path / "t.json").exists()
    assert parse_trace(path).kernels == ()  # CPU only: no GPU activity

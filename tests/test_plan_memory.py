"""experiments/plan_memory.py: its arguments, the subsets it switches and how it reads a graph pool, on the CPU."""

from __future__ import annotations

import pytest

from concur.inductor.stream_backend import CompiledGraphInfo
from experiments import plan_memory


def test_arguments_and_a_clear_exit_without_a_gpu(monkeypatch, tmp_path):
    args = plan_memory.parse_args(["--out", str(tmp_path), "--networks", "googlenet", "--batch", "8"])
    assert args.networks == ["googlenet"] and args.batch == 8 and args.rounds == 2
    monkeypatch.setattr(plan_memory.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        plan_memory.main(["--out", str(tmp_path)])


def test_each_subset_keeps_the_streams_of_its_kind_of_graph():
    forward, backward = (CompiledGraphInfo(b, 10, 10, 4, 3, None) for b in (False, True))
    kept = {name: (keeps(forward), keeps(backward)) for name, keeps in plan_memory.SUBSETS.items()}
    assert kept == {"all": (True, True), "forward": (True, False), "backward": (False, True), "none": (False, False)}


def test_the_pool_read_is_the_newest_graph_pools_by_stream():
    segments = {"default stream0": [96.0, 90.0], "pool0.9 stream0": [1300.0, 0.1], "pool0.9 stream1": [64.0, 12.0],
                "pool0.10 stream0": [1372.0, 26.0], "pool0.10 stream3": [84.0, 0.0]}
    assert plan_memory.pool_by_stream(segments) == {"stream0": 1372.0, "stream3": 84.0}
    assert plan_memory.pool_by_stream({"default stream0": [2.0, 0.0]}) == {}


def test_launching_allocations_leave_every_buffer_on_the_stream_that_first_uses_it(monkeypatch):
    from concur.inductor import wrapper_emit

    monkeypatch.setattr(wrapper_emit, "caller_allocations", wrapper_emit.caller_allocations)  # undone after
    assert plan_memory.parse_args(["--out", "x"]).allocations == "caller"
    plan_memory.allocate_on_launching_streams()
    assert wrapper_emit.caller_allocations(None, [], {}) == {}

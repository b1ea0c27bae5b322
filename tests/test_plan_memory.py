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


class Plan:
    """An installed program's switch and re-placement (``InstalledPlan``), keeping what runs: None (inductor's
    call), or the (streams, lean) it was last placed with."""

    def __init__(self, worth=True):
        self.running, self.worth, self.placed = (4, False), worth, (4, False)

    def use_streams(self, on):
        self.running = self.placed if on else None

    def fewer_streams(self, k, lean=False):
        if not self.worth:
            return None
        self.running = self.placed = (k, lean)
        return object()


def test_each_subset_runs_what_it_names_and_the_steps_of_a_step_short_of_memory_come_back_as_placed():
    forward, backward = (CompiledGraphInfo(b, 10, 10, 4, 3, None) for b in (False, True))
    fplan, bplan = Plan(), Plan()
    ran = {}
    for name, subset in list(plan_memory.SUBSETS.items()) * 2:  # every subset after every other
        plan_memory.run_subset(subset, [(forward, fplan), (backward, bplan)], 4)
        ran[name] = (fplan.running, bplan.running)
    assert ran == {"all": ((4, False), (4, False)), "forward": ((4, False), None),
                   "backward": (None, (4, False)), "none": (None, None),
                   "backward on 2": ((4, False), (2, False)), "backward lean": ((4, False), (2, True)),
                   "backward lean on all": ((4, False), (4, True))}
    lone = Plan(worth=False)  # a backward not worth placing again runs inductor's call in the lean step
    plan_memory.run_subset(plan_memory.SUBSETS["backward lean"], [(backward, lone)], 4)
    assert lone.running is None


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

"""An unfused captured step times its programs on its own first calls (concur.training.trial), on CPU.

The emulated runner captures by running the body and replays by running it
again; here it also times each replay with a fixed time per program (one
stream, or several) and replays each graph with the plan it was captured
with, as a CUDA graph would. What the tests see: which programs the first
calls replayed, what was decided and kept, how many captures it took, and
that the run equals the plain loop's throughout.
"""

from __future__ import annotations

import pytest
import torch

import concur
import concur.fx.decision as fx_decision
import concur.training.step as train_mod
from concur.training import trial as trial_mod
from tests.test_step_habits import EmulatedGraphs, assert_same_run, loss_fn, make_batches, make_model, plain_loop


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CONCUR_MEASURE", raising=False)
    # the step times its programs itself: nothing may time them before it
    monkeypatch.setattr(fx_decision, "replay_rounds", lambda *a, **k: pytest.fail("timed before the step"))
    return tmp_path


class Timing:
    """A replay's fake CUDA-event time; ``pending`` more checks say it has not completed yet. Waiting for it
    completes it and every replay before it, as on one stream."""

    def __init__(self, ms, pending=0, earlier=()):
        self._ms, self.pending, self.earlier, self.waits = ms, pending, list(earlier), 0

    def done(self):
        self.pending -= 1
        return self.pending < 0

    def wait(self):
        self.waits += 1
        for t in [*self.earlier, self]:
            t.pending = -1

    def ms(self):
        return self._ms


class TrialGraphs(EmulatedGraphs):
    """The emulated runner, timing replays: ``one_ms`` for a one-stream program, ``streams_ms`` otherwise."""

    def __init__(self, one_ms, streams_ms, pending=0):
        super().__init__()
        self.one_ms, self.streams_ms, self.pending = one_ms, streams_ms, pending
        self.plan_of = {}     # id(graph) -> (step, the plan it was captured with)
        self.replayed = []    # streams of each timed replay's program
        self.new_pools = 0
        self.timings = []     # every timed replay's fake timing, in order
        self.released = []    # per release of an old pool: whether no graph and no gradient held it any more
        self.last_step = None

    def can_time(self, device):
        return True

    def capture(self, body, step):
        self.last_step = step
        graph, out = super().capture(body, step)
        self.plan_of[id(graph)] = (step, step.module.plan)
        return graph, out

    def timed_replay(self, graph):
        step, plan = self.plan_of[id(graph)]
        module, now = step.module, step.module.plan
        module.run_plan(plan)  # a CUDA graph replays what it captured, whatever the module runs now
        try:
            graph.replay()
        finally:
            module.run_plan(now)
        streams = plan.schedule.num_streams
        self.replayed.append(streams)
        self.timings.append(Timing(self.one_ms if streams == 1 else self.streams_ms, self.pending, self.timings))
        return self.timings[-1]

    def new_pool(self):
        self.new_pools += 1
        self.old_pool = True

    def release_old_pool(self):
        if getattr(self, "old_pool", False):
            self.old_pool = False
            self.released.append(self.last_step is not None and not self.last_step.graphs
                                 and all(p.grad is None for p in self.last_step.model.parameters()))


def trial_run(monkeypatch, runner, n=24, **kw):
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    batches = make_batches(n=n)
    ref, model = make_model(), make_model()
    expected = plain_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), batches)
    step = concur.train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             batches[0], streams=4, **kw)
    losses = [step(x, y).item() for x, y in batches]
    assert_same_run(losses, expected, model, ref)
    return step


# the calls a settled trial takes: a round not counted, then decide.SETTLED_ROUNDS, two programs, REPLAYS each
SETTLED_CALLS = (1 + 3) * 2 * trial_mod.REPLAYS


def test_first_calls_time_both_programs_and_keep_the_faster(monkeypatch):
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8)
    step = trial_run(monkeypatch, runner)
    assert runner.captures == 3 and runner.new_pools == 1, \
        "one capture per program, nothing timed before the step; the kept one again, in a pool of its own"
    assert sorted(set(runner.replayed)) == [1, 2] and len(runner.replayed) == SETTLED_CALLS
    # rounds rotate the order: each program REPLAYS times in a row, the other first in the next round
    assert runner.replayed[:8] == [1, 1, 2, 2, 2, 2, 1, 1]
    (decision,) = step.step_decisions
    assert decision.keep and decision.source == "measurement" and decision.measured.rounds == 3
    assert not step.deciding and len(step.graphs) == 1 and step.module.plan.schedule.num_streams == 2
    assert runner.plan_of[id(next(iter(step.graphs.values())).graph)][1].schedule.num_streams == 2


def test_one_stream_faster_is_captured_again_in_a_new_pool(monkeypatch):
    runner = TrialGraphs(one_ms=1.0, streams_ms=1.2)
    step = trial_run(monkeypatch, runner)
    (decision,) = step.step_decisions
    assert not decision.keep and step.module.plan.schedule.num_streams == 1
    assert runner.new_pools == 1 and runner.captures == 3, "dropped: the one-stream step captured anew"
    assert runner.plan_of[id(next(iter(step.graphs.values())).graph)][1].schedule.num_streams == 1


def test_a_second_step_reads_the_cached_decision_and_captures_once(monkeypatch):
    trial_run(monkeypatch, TrialGraphs(one_ms=1.0, streams_ms=1.2))
    runner = TrialGraphs(one_ms=1.0, streams_ms=1.2)
    step = trial_run(monkeypatch, runner, n=3)
    assert runner.captures == 1 and not runner.replayed and not step.step_decisions
    assert step.module.plan.schedule.num_streams == 1


def test_rounds_count_only_replays_that_completed(monkeypatch):
    """Events that complete late: no call waits for them before enough rounds are issued to decide."""
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8, pending=40)  # each event completes 40 checks late
    step = trial_run(monkeypatch, runner, n=SETTLED_CALLS - 1)
    assert step.deciding and not step.step_decisions, "decided on times not yet completed"
    assert not any(t.waits for t in runner.timings), "waited for the device before enough rounds were issued"


def test_the_call_that_issues_enough_rounds_waits_for_them_and_decides(monkeypatch):
    """Without the wait the host runs ahead and the programs keep alternating until the device catches up."""
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8, pending=40)
    step = trial_run(monkeypatch, runner, n=SETTLED_CALLS + 3)
    assert len(runner.replayed) == SETTLED_CALLS, "decided on the call that ended the third counted round"
    assert sum(t.waits for t in runner.timings) == 1 and runner.timings[-1].waits == 1
    (decision,) = step.step_decisions
    assert decision.keep and decision.measured.rounds == 3


def test_accumulation_times_before_the_step_not_during_it(monkeypatch):
    monkeypatch.setattr(fx_decision, "replay_rounds", lambda programs, device: [(1.0, 0.8)] * 3)
    import concur.fx.module as fx_module
    monkeypatch.setattr(fx_module, "can_time", lambda device: True)
    monkeypatch.setattr(fx_module, "cuda_device", lambda model, inputs: torch.device("cpu"))
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8)
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    model = make_model()
    step = concur.train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), make_batches(1)[0],
                             streams=4, accumulate=2)
    for x, y in make_batches(n=4):
        step(x, y)
    assert not runner.replayed and step._trial is None and not step.step_decisions


def test_every_program_warms_up_before_the_first_capture_and_later_ones_once(monkeypatch):
    """The step's warmup passes before the one-stream program, one pass before the trial's other program and
    before the capture again after the decision (its shapes were warmed up already); no warm-up's activations
    alive beside a graph already captured."""
    import concur.training.capture as capture_mod

    events = []
    backward_from_none = capture_mod.backward_from_none
    monkeypatch.setattr(capture_mod, "backward_from_none",
                        lambda step, module, *a: events.append(("pass", module.plan.schedule.num_streams))
                        or backward_from_none(step, module, *a))

    class Logged(TrialGraphs):
        def capture(self, body, step):
            events.append(("capture", step.module.plan.schedule.num_streams))
            return super().capture(body, step)

        def release_old_pool(self):
            if getattr(self, "old_pool", False):
                events.append(("release", None))
            super().release_old_pool()

    runner = Logged(one_ms=1.0, streams_ms=1.2)
    trial_run(monkeypatch, runner)
    assert events == [("pass", 1)] * 3 + [("pass", 2), ("capture", 1), ("capture", 2), ("release", None),
                                          ("pass", 1), ("capture", 1)], \
        "the trial's pool is given back before the warm-up of the capture after the decision"
    assert runner.released == [True], "no graph or gradient of the trial alive when its pool is given back"


def test_optimize_refuses_a_measure_it_does_not_know():
    with pytest.raises(ValueError, match="measure must be True, False or 'deferred'"):
        concur.optimize(make_model(), (make_batches(1)[0][0],), streams=2, measure="later")

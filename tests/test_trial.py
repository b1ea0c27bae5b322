"""An unfused captured step times its programs on its own first calls (concur.training.trial), on CPU.

The emulated runner captures by running the body and replays by running it
again; here it also times each replay with a fixed time per program (one
stream, or several) and replays each graph with the plan it was captured
with, as a CUDA graph would. What the tests see: which programs the first
calls replayed, what was decided and kept, how many captures it took, and
that the run equals the plain loop's throughout.
"""

from __future__ import annotations

import gc
import types
import warnings
import weakref

import pytest
import torch

import concur
import concur.fx.plan_timing as fx_plan_timing
import concur.training.capture as capture_mod
import concur.training.step as train_mod
from concur.training import rungs, trial as trial_mod
from tests.models import Towers
from tests.test_step_habits import EmulatedGraphs, assert_same_run, loss_fn, make_batches, make_model, plain_loop


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CONCUR_MEASURE", raising=False)
    # the step times its programs itself: nothing may time them before it
    monkeypatch.setattr(fx_plan_timing, "replay_rounds", lambda *a, **k: pytest.fail("timed before the step"))
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
    """The emulated runner, timing replays: ``one_ms`` for a one-stream program, ``streams_ms`` otherwise (or
    ``streams_ms[streams]``)."""

    def __init__(self, one_ms, streams_ms, pending=0):
        super().__init__()
        self.one_ms, self.streams_ms, self.pending = one_ms, streams_ms, pending
        self.plan_of = {}     # id(graph) -> (step, the plan it was captured with)
        self.replayed = []    # streams of each timed replay's program
        self.new_pools = 0
        self.timings = []     # every timed replay's fake timing, in order
        self.released = []    # per release of an old pool: whether no graph and no gradient held it any more
        self._in_pool = []    # weak references to the graphs captured into the current pool
        self.last_step = None

    def can_time(self, device):
        return True

    def capture(self, body, step):
        self.last_step = step
        graph, out = super().capture(body, step)
        self.plan_of[id(graph)] = (step, step.module.plan)
        self._in_pool.append(weakref.ref(graph))
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
        ms = self.one_ms if streams == 1 else \
            self.streams_ms[streams] if isinstance(self.streams_ms, dict) else self.streams_ms
        self.timings.append(Timing(ms, self.pending, self.timings))
        return self.timings[-1]

    def new_pool(self):
        self.new_pools += 1
        self.old_pool, self._old_graphs, self._in_pool = True, self._in_pool, []

    def release_old_pool(self):
        # a real pool goes back to the device only once every graph captured into it is destroyed: one the step
        # still refers to anywhere keeps all of its blocks reserved
        if getattr(self, "old_pool", False):
            self.old_pool = False
            gc.collect()
            self.released.append(self.last_step is not None and not self.last_step.graphs
                                 and all(p.grad is None for p in self.last_step.model.parameters())
                                 and all(ref() is None for ref in self._old_graphs))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def four_towers(seed=0):
    """Four towers on a shared stem: plans on 2, 3 and 4 streams differ."""
    torch.manual_seed(seed)
    return Towers(32, (32,) * 4).double()


@pytest.fixture
def side_by_side(monkeypatch):
    """Every program captured at once where they fit (``trial.SIDE_BY_SIDE``; one at a time is the default)."""
    monkeypatch.setattr(trial_mod, "SIDE_BY_SIDE", True)


def trial_run(monkeypatch, runner, n=24, batches=None, make_opt=sgd, before_step=None, model_fn=make_model, **kw):
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    batches = batches or make_batches(n=n)
    ref, model = model_fn(), model_fn()
    expected = plain_loop(ref, make_opt(ref.parameters()), batches, before_step=before_step)
    step = concur.train_step(model, loss_fn, make_opt(model.parameters()), batches[0],
                             **{"streams": 4, "before_step": before_step, **kw})
    losses = [step(x, y).item() for x, y in batches]
    assert_same_run(losses, expected, model, ref)
    return step


# the calls a settled trial takes: a round not counted, then decide.SETTLED_ROUNDS, two programs, REPLAYS each
SETTLED_CALLS = (1 + 3) * 2 * trial_mod.REPLAYS


@pytest.mark.usefixtures("side_by_side")
def test_first_calls_time_both_programs_and_keep_the_faster(monkeypatch):
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8)
    step = trial_run(monkeypatch, runner)
    assert runner.captures == 3 and runner.new_pools == 1, \
        "one capture per program, nothing timed before the step; the kept one again, in a pool of its own"
    assert runner.released == [True], "the trial's pool given back with no graph of it alive"
    assert sorted(set(runner.replayed)) == [1, 2] and len(runner.replayed) == SETTLED_CALLS
    # rounds rotate the order: each program REPLAYS times in a row, the other first in the next round
    assert runner.replayed[:8] == [1, 1, 2, 2, 2, 2, 1, 1]
    (decision,) = step.step_decisions
    assert decision.keep and decision.source == "measurement" and decision.measured.rounds == 3
    assert not step.deciding and len(step.graphs) == 1 and step.module.plan.schedule.num_streams == 2
    assert runner.plan_of[id(next(iter(step.graphs.values())).graph)][1].schedule.num_streams == 2


@pytest.mark.usefixtures("side_by_side")
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


@pytest.mark.usefixtures("side_by_side")
def test_the_call_that_issues_enough_rounds_waits_for_them_and_decides(monkeypatch):
    """Without the wait the host runs ahead and the programs keep alternating until the device catches up."""
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8, pending=40)
    step = trial_run(monkeypatch, runner, n=SETTLED_CALLS + 3)
    assert len(runner.replayed) == SETTLED_CALLS, "decided on the call that ended the third counted round"
    assert sum(t.waits for t in runner.timings) == 1 and runner.timings[-1].waits == 1
    (decision,) = step.step_decisions
    assert decision.keep and decision.measured.rounds == 3


def test_accumulation_times_before_the_step_not_during_it(monkeypatch):
    monkeypatch.setattr(fx_plan_timing, "replay_rounds", lambda programs, device: [(1.0, 0.8)] * 3)
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


@pytest.mark.usefixtures("side_by_side")
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


def test_another_shape_during_the_trial_runs_the_chosen_program_after_it(monkeypatch):
    """A smaller batch now and then (a last batch, a second loader) is captured with the predicted plan while
    the trial runs; once one stream wins, every shape is captured again with it, and the run stays the plain
    loop's throughout."""
    batches = make_batches(n=30)
    small = make_batches(n=30, size=3, seed=2)
    mixed = [small[i] if i % 5 == 4 else b for i, b in enumerate(batches)]
    runner = TrialGraphs(one_ms=1.0, streams_ms=1.2)
    step = trial_run(monkeypatch, runner, batches=mixed)
    (decision,) = step.step_decisions
    assert not decision.keep and len(step.graphs) == 2
    assert all(runner.plan_of[id(c.graph)][1].schedule.num_streams == 1 for c in step.graphs.values())


def test_the_trial_keeps_clipping_and_adam_as_the_plain_loop_runs_them(monkeypatch):
    clip = lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)  # noqa: E731
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8)
    step = trial_run(monkeypatch, runner, make_opt=lambda p: torch.optim.Adam(p, lr=0.01), before_step=clip)
    (decision,) = step.step_decisions
    assert decision.keep and decision.source == "measurement" and not step.deciding


@pytest.mark.usefixtures("side_by_side")
def test_auto_times_every_stream_count_on_the_first_calls_and_keeps_the_fewest_within_the_margin(monkeypatch):
    runner = TrialGraphs(one_ms=1.0, streams_ms={2: 0.9, 3: 0.8, 4: 0.8})
    step = trial_run(monkeypatch, runner, n=70, streams="auto", model_fn=four_towers)  # 8 rounds of 8 calls
    (decision,) = step.step_decisions
    timed = sorted(set(runner.replayed))
    assert timed[0] == 1 and len(timed) >= 3, f"one stream and several candidates timed: {timed}"
    assert decision.keep and decision.num_streams == 3 and step.module.plan.schedule.num_streams == 3


class FailsOnce(TrialGraphs):
    """The trial's capture number ``at`` (of every program at once: 0 the one-stream program's, 1 the plan's)
    fails once, ``fail()`` raising; so do the captures numbered in ``then`` (the one-stream program, alone)."""

    def __init__(self, fail, then=(), at=1, **timing):
        super().__init__(**timing)
        self.fail, self.fail_at = fail, {at, *then}

    def capture(self, body, step):
        if self.captures in self.fail_at:
            self.fail_at.discard(self.captures)
            self.fail()
        return super().capture(body, step)


def out_of_memory_at_capture_end():
    """The allocator's error, and the one a capture raises at its end while handling it."""
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError:
        raise RuntimeError("CUDA error: capturing stream has unjoined work")


def not_permitted_while_capturing():
    raise RuntimeError("operation not permitted when stream is capturing")


# the calls a trial one program at a time takes: each program's, one not counted, then the counted ones
ONE_AT_A_TIME_CALLS = 2 * trial_mod.PHASE


@pytest.mark.usefixtures("side_by_side")
@pytest.mark.parametrize("streams_ms, failed_at", [(1.2, 1), (0.8, 1), (0.8, 0)])
def test_where_every_program_does_not_fit_each_is_timed_alone_and_the_faster_kept(monkeypatch, caplog,
                                                                                   streams_ms, failed_at):
    """Out of memory capturing every program at once: the predicted program is captured alone and timed on
    the first calls, then freed and the one-stream program captured in a new pool and timed; the faster is
    kept, not cached (a plan kept on its prediction under memory pressure can be much slower), the INFO line
    says how it was timed, and the run equals the plain loop throughout. Whichever program's capture ran out
    (``failed_at``), the plan is timed first."""
    runner = FailsOnce(out_of_memory_at_capture_end, at=failed_at, one_ms=1.0, streams_ms=streams_ms)
    with caplog.at_level("INFO", logger="concur"):
        step = trial_run(monkeypatch, runner)
    assert "timed one at a time, side by side they do not fit in memory" in caplog.text
    (decision,) = step.step_decisions
    assert decision.source == "measurement" and decision.keep == (streams_ms < 1.0), decision.reason
    assert decision.measured.rounds == trial_mod.ROUNDS
    assert runner.replayed == [2] * trial_mod.PHASE + [1] * trial_mod.PHASE, "the predicted program first"
    assert runner.released[0], "the predicted program's pool given back before the one-stream program's capture"
    kept = 2 if streams_ms < 1.0 else 1
    # captured: the one-stream program beside the plan (where it was not the one that failed), the plan alone, the
    # one-stream program alone; the plan, where it wins, again (its pool went back); one stream's graph stays
    assert runner.captures == (4 if kept == 2 else 3) - (failed_at == 0)
    assert runner.new_pools == (2 if kept == 2 else 1)
    assert not step.deciding and len(step.graphs) == 1 and step.module.plan.schedule.num_streams == kept
    assert runner.plan_of[id(next(iter(step.graphs.values())).graph)][1].schedule.num_streams == kept
    assert step.status.streams == kept and step.status.failures == 1 and not step.failed_streams
    again = FailsOnce(out_of_memory_at_capture_end, one_ms=1.0, streams_ms=streams_ms)
    trial_run(monkeypatch, again)
    assert again.replayed, "not cached: the next run times again"


@pytest.mark.parametrize("streams_ms", [1.2, 0.8])
def test_by_default_the_first_calls_time_the_programs_one_at_a_time(monkeypatch, caplog, streams_ms):
    """The default (``trial.SIDE_BY_SIDE`` off): nothing fails, yet no capture holds every program at once; the
    predicted program is captured alone and timed, then the one-stream program, and the faster is kept."""
    monkeypatch.setattr(capture_mod, "capture_trial", lambda *a, **k: pytest.fail("every program captured at once"))
    runner = TrialGraphs(one_ms=1.0, streams_ms=streams_ms)
    with caplog.at_level("INFO", logger="concur"):
        step = trial_run(monkeypatch, runner)
    assert "timed one at a time, to hold one program's memory at a time" in caplog.text
    (decision,) = step.step_decisions
    kept = 2 if streams_ms < 1.0 else 1
    assert decision.source == "measurement" and decision.keep == (kept == 2), decision.reason
    assert runner.replayed == [2] * trial_mod.PHASE + [1] * trial_mod.PHASE, "the predicted program first"
    assert runner.captures == (3 if kept == 2 else 2) and runner.released[0]
    assert step.module.plan.schedule.num_streams == kept and step.status.failures == 0
    again = TrialGraphs(one_ms=1.0, streams_ms=streams_ms)
    step = trial_run(monkeypatch, again, n=3)
    assert again.captures == 1 and not again.replayed, "cached: one candidate, nothing narrowed"
    assert step.module.plan.schedule.num_streams == kept


def test_one_at_a_time_a_choice_narrowed_from_several_candidates_is_not_cached(monkeypatch):
    runner = TrialGraphs(one_ms=1.0, streams_ms={2: 0.8, 3: 0.7, 4: 0.75})
    trial_run(monkeypatch, runner, streams="auto", model_fn=four_towers)
    assert len(set(runner.replayed)) == 2, "one stream and the predicted candidate, one at a time"
    again = TrialGraphs(one_ms=1.0, streams_ms={2: 0.8, 3: 0.7, 4: 0.75})
    trial_run(monkeypatch, again, streams="auto", model_fn=four_towers)
    assert again.replayed, "not cached: the cache holds decisions between every candidate"


@pytest.mark.usefixtures("side_by_side")
@pytest.mark.parametrize("streams_ms", [1.2, 0.8])
def test_another_shape_while_programs_are_timed_one_at_a_time_trains_as_the_plain_loop(monkeypatch, streams_ms):
    """A smaller batch now and then while the programs are timed one at a time: it runs the plan the module runs
    then, its graph freed with the others' when the one-stream program is captured and when the choice is
    made; the run stays the plain loop's, and every shape ends on the program kept."""
    batches = make_batches(n=36)
    small = make_batches(n=36, size=3, seed=2)
    mixed = [small[i] if i % 5 == 4 else b for i, b in enumerate(batches)]
    runner = FailsOnce(out_of_memory_at_capture_end, one_ms=1.0, streams_ms=streams_ms)
    step = trial_run(monkeypatch, runner, batches=mixed)
    (decision,) = step.step_decisions
    kept = 2 if streams_ms < 1.0 else 1
    assert decision.source == "measurement" and decision.keep == (kept == 2) and not step.deciding
    assert len(step.graphs) == 2
    assert all(runner.plan_of[id(c.graph)][1].schedule.num_streams == kept for c in step.graphs.values())


@pytest.mark.usefixtures("side_by_side")
def test_where_the_one_stream_program_alone_cannot_be_captured_the_prediction_decides(monkeypatch):
    runner = FailsOnce(out_of_memory_at_capture_end, then=(2,), one_ms=1.0, streams_ms=1.2)
    step = trial_run(monkeypatch, runner)
    (decision,) = step.step_decisions
    assert decision.keep and decision.source == "prediction" and not step.deciding
    assert "capturing the programs to time them failed" in decision.reason, decision.reason
    assert runner.replayed == [2] * trial_mod.PHASE, "the predicted program's calls, then no more timing"
    assert step.status.streams == 2 and step.status.failures == 2


@pytest.mark.usefixtures("side_by_side")
def test_where_every_program_fails_for_another_reason_the_prediction_decides(monkeypatch):
    """Not out of memory (an operation a capture does not allow, say): the predicted plan alone is captured,
    as where a timing before the step fails; not cached, and no fallback to one stream."""
    runner = FailsOnce(not_permitted_while_capturing, one_ms=1.0, streams_ms=1.2)
    step = trial_run(monkeypatch, runner)
    (decision,) = step.step_decisions
    assert decision.keep and decision.source == "prediction"
    assert "operation not permitted when stream is capturing" in decision.reason, decision.reason
    assert not step.deciding and not runner.replayed and not step.failed_streams
    assert len(step.graphs) == 1 and step.module.plan.schedule.num_streams == 2
    assert step.status.streams == 2 and step.status.failures == 1  # the trial's capture, not the step's
    again = trial_run(monkeypatch, TrialGraphs(one_ms=1.0, streams_ms=1.2))
    assert again.step_decisions[0].source == "measurement", "the untimed decision was not cached"


def test_where_the_predicted_program_alone_does_not_fit_either_the_step_runs_one_stream(monkeypatch):
    """Out of memory capturing the trial, then capturing the predicted program alone: one stream, with one
    warning saying what was missing, and the same run as the plain loop."""

    class OutOfMemoryTwice(TrialGraphs):
        failures = 0

        def capture(self, body, step):
            if self.captures >= 1 and self.failures < 2:
                self.failures += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().capture(body, step)

    monkeypatch.setattr(rungs, "CALLER_MEMORY_AFTER_OUT_OF_MEMORY", False)  # the ladder of stream counts alone
    with pytest.warns(UserWarning, match="does not fit in memory .*2.00 GiB"):
        step = trial_run(monkeypatch, OutOfMemoryTwice(one_ms=1.0, streams_ms=1.2))
    assert step.failed_streams == {4} and step.status.streams == 1 and step.status.captured
    # two towers: the plan asked for on 4 streams runs on 2, so 2 streams would not be narrower
    assert 2 not in step.modules and step.module is step.modules[1]


class OutOfMemoryOn(TrialGraphs):
    """Every capture of the module on one of ``streams`` (its plans, one stream's too) runs out of memory."""

    def __init__(self, streams, **timing):
        super().__init__(**timing)
        self.out_of_memory_on, self.tried = set(streams), []

    def capture(self, body, step):
        module = step.module
        asked = next(s for s, m in step.modules.items() if m is module)
        self.tried.append(asked)
        if asked in self.out_of_memory_on:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {asked}.00 MiB")
        return super().capture(body, step)


def test_an_unfused_step_on_4_streams_that_does_not_fit_runs_2_streams_and_times_them_on_its_first_calls(
        monkeypatch):
    """Side streams keep their blocks apart, so 2 streams may fit where 4 do not: the step tries 2 before 1,
    times its 2-stream program against one stream on its first calls as it would have the 4, and keeps it.
    One warning says what 4 streams missed and what runs; the run equals the plain loop. (The ladder of stream
    counts alone: the caller-memory rung, tried first by default, is the next test's.)"""
    monkeypatch.setattr(rungs, "CALLER_MEMORY_AFTER_OUT_OF_MEMORY", False)
    runner = OutOfMemoryOn({4}, one_ms=1.0, streams_ms=0.8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = trial_run(monkeypatch, runner, model_fn=four_towers, n=40)
    said = [str(w.message) for w in caught if "concur.train_step" in str(w.message)]
    assert said == ["concur.train_step: the step on 4 streams does not fit in memory (an allocation of 4.00 MiB "
                    "did not fit); running it on 2 streams instead, for this and later input shapes."], said
    assert set(runner.tried) == {4, 2} and step.failed_streams == {4} and 4 not in step.modules
    assert step.module is step.modules[2] and step.module.plan.schedule.num_streams == 2
    four, two = step.step_decisions  # the 4-stream plan by prediction (its capture failed), then the 2's timed
    assert four.source == "prediction" and two.source == "measurement" and two.keep
    status = step.status
    assert status.captured and status.streams == 2 and "4 streams does not fit in memory" in status.why
    assert "2 streams of 4 asked for" in str(status)


class OutOfMemoryWithoutCallerMemory(TrialGraphs):
    """Every capture of a multi-stream plan whose side streams keep their own memory runs out of it; the same plan
    with its side streams' memory and its backward the caller's stream's (concur.caller_memory) fits."""

    def __init__(self, **timing):
        super().__init__(**timing)
        self.tried = []

    def capture(self, body, step):
        plan = step.module.plan
        self.tried.append((plan.schedule.num_streams, plan.runtime.caller_memory))
        if plan.schedule.num_streams > 1 and not plan.runtime.caller_memory:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 170.00 MiB")
        return super().capture(body, step)


def test_by_default_a_step_on_4_streams_that_does_not_fit_keeps_them_with_the_callers_memory(monkeypatch):
    """By default an unfused rung that runs out of memory is captured once more on as many streams with the
    caller's memory before fewer streams; its first calls time it against one stream as any plan's, and the
    program kept is captured again with the caller's memory. One warning says what was missing and what runs."""
    runner = OutOfMemoryWithoutCallerMemory(one_ms=1.0, streams_ms=0.8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = trial_run(monkeypatch, runner, model_fn=four_towers, n=40)
    said = [str(w.message) for w in caught if "concur.train_step" in str(w.message)]
    assert said == ["concur.train_step: the step on 4 streams does not fit in memory (an allocation of 170.00 MiB "
                    "did not fit); running it on 4 streams, its side streams' memory and its backward the caller's "
                    "stream's instead, for this and later input shapes."], said
    assert runner.tried == [(4, False), (4, True), (1, False), (4, True)], runner.tried
    assert step.failed_streams == set() and step.caller_memory and step.module is step.modules[4]
    plain, timed = step.step_decisions  # by prediction where the plain capture failed, then the caller-memory one's
    assert plain.source == "prediction" and timed.source == "measurement" and timed.keep
    assert step.status.captured and step.status.streams == 4


def test_where_2_streams_do_not_fit_either_the_step_runs_one_and_one_warning_says_what_each_missed(monkeypatch):
    runner = OutOfMemoryOn({4, 2}, one_ms=1.0, streams_ms=0.8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = trial_run(monkeypatch, runner, model_fn=four_towers)
    (said,) = [str(w.message) for w in caught if "concur.train_step" in str(w.message)]
    assert "4 streams does not fit in memory (an allocation of 4.00 MiB" in said
    assert "2 streams does not fit in memory (an allocation of 2.00 MiB" in said
    assert said.endswith("running it on 1 stream instead, for this and later input shapes.")
    assert step.failed_streams == {4, 2} and step.status.streams == 1 and step.module is step.modules[1]
    assert runner.tried[-1] == 1


def test_a_capture_on_4_streams_that_fails_for_another_reason_than_memory_goes_to_one_stream(monkeypatch):
    """Fewer side streams would not help a failure memory does not explain: no attempt on 2."""
    class Invalidated(OutOfMemoryOn):
        def capture(self, body, step):
            if step.module is step.modules.get(4):
                self.tried.append(4)
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture(body, step)

    runner = Invalidated({4}, one_ms=1.0, streams_ms=0.8)
    with pytest.warns(UserWarning, match="capturing the step on 4 streams failed 2 times"):
        step = trial_run(monkeypatch, runner, model_fn=four_towers)
    assert 2 not in runner.tried and step.failed_streams == {4} and step.status.streams == 1


@pytest.mark.parametrize("asked, compiled, expected", [
    (4, False, [4, 2, 1]), (3, False, [3, 2, 1]), ("auto", False, ["auto", 2, 1]), (2, False, [2, 1]),
    (1, False, [1]), (4, True, [4, 1]), ("auto", True, ["auto", 1])])
def test_the_rungs_a_step_tries_where_memory_runs_out(asked, compiled, expected):
    """A compiled step narrows its backward in the same module instead: a new module would compile again."""
    step = types.SimpleNamespace(requested_streams=asked, compile=compiled)
    assert rungs.stream_rungs(step) == expected
    assert (rungs.describe(4), rungs.describe(1), rungs.describe("auto")) == ("4 streams", "1 stream", "streams='auto'")


def test_a_new_plan_after_the_model_changed_is_timed_on_the_calls_after_it(monkeypatch):
    """A submodule replaced after the first trial: the step rebuilds its plans and times the new ones too,
    though graphs of the old model are still cached."""
    runner = TrialGraphs(one_ms=1.0, streams_ms=0.8)
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    batches = make_batches(n=40)
    model = make_model()
    step = concur.train_step(model, loss_fn, sgd(model.parameters()), batches[0], streams=4)
    for x, y in batches[:20]:
        step(x, y)
    assert len(step.step_decisions) == 1 and step.graphs
    model.b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sigmoid()).double()
    for x, y in batches[20:]:
        step(x, y)
    assert len(step.step_decisions) == 2 and step.step_decisions[1].source == "measurement"


def test_a_decided_trial_says_how_many_other_processes_shared_its_gpu(monkeypatch):
    """What the first calls' timing saw of other processes on the GPU reaches the decision (decide does not reuse
    one timed beside them): asked of the trial's device once the rounds decide."""
    class Done:
        def __init__(self, ms):
            self._ms = ms

        def done(self):
            return True

        def wait(self):
            pass

        def ms(self):
            return self._ms

    asked = []
    monkeypatch.setattr(trial_mod.measure, "others_timing_beside", lambda device: asked.append(device) or 2)
    trial = trial_mod.StepTrial(("shape",), ["one stream", "plan"], device=torch.device("cuda", 0))
    for _ in range(SETTLED_CALLS):
        i, _program = trial.next_program()
        trial.replayed(i, Done(1.0 if i == 0 else 0.5))
    rounds = trial.decided()
    assert rounds is not None and rounds.others == 2 and asked == [torch.device("cuda", 0)]


@pytest.mark.parametrize("side", [False, True], ids=["one at a time", "side by side"])
def test_where_one_stream_wins_the_side_streams_cublas_workspaces_go_back_while_no_graph_lives(monkeypatch, side):
    """cuBLAS keeps a workspace per stream for the life of the process (32 MiB each on the GPU): the multi-stream
    program's are given back once its graph is dropped, before the one-stream program is captured."""
    from concur import _torch_compat as compat

    monkeypatch.setattr(trial_mod, "SIDE_BY_SIDE", side)
    runner = TrialGraphs(one_ms=1.0, streams_ms=1.2)
    cleared = []  # at each call: the graphs the step still held
    monkeypatch.setattr(compat, "clear_cublas_workspaces",
                        lambda: cleared.append(len(runner.last_step.graphs) if runner.last_step else 0))
    step = trial_run(monkeypatch, runner)
    assert step.module.plan.schedule.num_streams == 1
    assert cleared and all(n == 0 for n in cleared), cleared

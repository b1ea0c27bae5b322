"""training/capture.py: a setup that fails (out of memory, a capture the driver invalidates) never costs the user's run.

Faults are faked at each point of setup (the trial of programs is in
tests/test_trial.py, a timing in tests/test_decide.py): a warm-up or
capture that runs out of memory drops to one stream at once, with one
warning that says how much memory was missing; a capture that fails for
another reason is tried again in a new pool; eager execution is the last
resort, says why, and ``recapture()`` captures again. Every run must still
equal the plain loop's, and :attr:`TrainStep.status` says how it ran.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import concur
import concur.training.step as train_mod
from concur.dag import measure
from concur.training import graph_runner, rungs
from tests.fake_cuda_graphs import fake_cuda
from tests.test_step_habits import (SGD_M, EmulatedGraphs, assert_same_run, loss_fn, make_batches, make_model,
                                    plain_loop)

OOM = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which " \
      "12.00 MiB is free. 4.00 GiB allowed; Of the allocated memory 3.90 GiB is allocated by PyTorch"


class FailingGraphs(EmulatedGraphs):
    """Captures that raise ``errors[i]`` (an exception, or None for success) at the i-th attempt, and log each
    attempt's stream count and what was given back after a failure."""

    def __init__(self, errors):
        super().__init__()
        self.errors = list(errors)
        self.attempts = []   # the step's stream count at each capture attempt
        self.freed = 0       # failed() calls: what a failed attempt held, given back
        self.pools = 0       # new_pool() calls

    def capture(self, body, step):
        self.attempts.append(step.capture_log.captures)
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return super().capture(body, step)

    def failed(self):
        self.freed += 1

    def new_pool(self):
        self.pools += 1


def run(monkeypatch, runner, batches, events=None, streams=2, make=make_model, caller_memory=False):
    """Train ``batches`` with ``runner``'s graphs and check the run equals the plain loop's; return the step and
    its warnings. ``caller_memory``: whether a rung out of memory is tried again with the caller's memory
    (concur.caller_memory) before fewer streams; off here, where the tests follow the ladder of stream counts."""
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    monkeypatch.setattr(rungs, "CALLER_MEMORY_AFTER_OUT_OF_MEMORY", caller_memory)
    model, ref = make(), make()
    opt, ref_opt = SGD_M(model), SGD_M(ref)
    step = concur.train_step(model, loss_fn, opt, batches[0], streams=streams)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = []
        for i, (x, y) in enumerate(batches):
            if events and i in events:
                events[i](model, opt)
            losses.append(step(x, y).item())
    expected = plain_loop(ref, ref_opt, batches, events=events)
    assert_same_run(losses, expected, model, ref)
    return step, [str(w.message) for w in caught if "concur.train_step" in str(w.message)]


def test_out_of_memory_capturing_streams_drops_to_one_stream_at_once_and_says_what_was_missing(monkeypatch):
    runner = FailingGraphs([torch.OutOfMemoryError(OOM)])
    step, said = run(monkeypatch, runner, make_batches(6) + make_batches(3, size=4))
    assert len(runner.attempts) == 3, "one failed attempt on 2 streams (not retried), then one graph per shape"
    assert step.failed_streams == {2} and 2 not in step.modules
    assert runner.freed >= 1, "the failed attempt's memory must be given back before the next"
    (warning,) = said
    assert "does not fit in memory" in warning and "20.00 MiB" in warning and "12.00 MiB free" in warning
    assert "4.00 GiB" in warning and "1 stream" in warning
    status = step.status
    assert status.captured and status.streams == 1 and "does not fit in memory" in status.why
    assert (status.captures, status.failures, status.recovered) == (2, 1, 0)
    assert "1 stream of 2 asked for" in str(status)


def test_out_of_memory_on_streams_tries_them_again_with_the_callers_memory_and_keeps_them(monkeypatch):
    """An unfused rung that runs out of memory is captured once more on as many streams, its side streams' ops
    launched with the caller's memory and its backward the caller's (concur.caller_memory), before fewer streams."""
    runner = FailingGraphs([torch.OutOfMemoryError(OOM)])
    step, said = run(monkeypatch, runner, make_batches(6), caller_memory=True)
    assert step.failed_streams == set() and step.caller_memory
    assert step.module.plan.runtime.caller_memory and step.module.plan.schedule.num_streams == 2
    (warning,) = said
    assert "the step on 2 streams does not fit in memory" in warning and "20.00 MiB" in warning
    assert "running it on 2 streams, its side streams' memory and its backward the caller's stream's" in warning
    status = step.status
    assert status.captured and status.streams == 2 and (status.captures, status.failures) == (1, 1)


def test_where_the_callers_memory_does_not_fit_either_the_step_drops_to_one_stream(monkeypatch):
    runner = FailingGraphs([torch.OutOfMemoryError(OOM), torch.OutOfMemoryError(OOM)])
    step, said = run(monkeypatch, runner, make_batches(6), caller_memory=True)
    assert step.failed_streams == {2} and step.status.streams == 1
    (warning,) = said
    assert warning.count("the step on 2 streams does not fit in memory") == 2 and "1 stream" in warning
    assert runner.freed >= 2, "each failed attempt's memory is given back before the next"


def test_out_of_memory_in_warm_up_falls_back_like_one_in_capture(monkeypatch):
    """The warm-up of the two-stream module runs out of memory: one stream, same run as the plain loop."""
    runner = FailingGraphs([])
    body = train_mod.StepBody.backward
    calls = []

    def backward(self, loss):
        calls.append(self)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(OOM)
        return body(self, loss)

    monkeypatch.setattr(train_mod.StepBody, "backward", backward)
    step, said = run(monkeypatch, runner, make_batches(5))
    assert step.failed_streams == {2} and step.status.streams == 1
    assert len(said) == 1 and "does not fit in memory" in said[0]


def test_out_of_memory_at_a_recapture_after_freezing_falls_back_and_keeps_training(monkeypatch):
    """The capture after a change (half the model frozen) runs out of memory: that graph and later ones run one
    stream; the graph captured before keeps its streams until it is evicted, and the run equals the plain loop."""
    runner = FailingGraphs([None, torch.OutOfMemoryError(OOM)])

    def freeze(model, opt):
        for p in model.a.parameters():
            p.requires_grad_(False)

    step, said = run(monkeypatch, runner, make_batches(8), events={4: freeze})
    assert step.failed_streams == {2} and len(said) == 1
    assert step.status.streams == 1 and step.status.failures == 1


def test_a_capture_that_fails_once_for_another_reason_is_retried_in_a_new_pool(monkeypatch):
    """What the stress run saw: a capture invalidated by a graph freed mid-capture. The retry recovers it, on
    the streams asked for, with no warning."""
    runner = FailingGraphs([RuntimeError("operation not permitted when stream is capturing")])
    step, said = run(monkeypatch, runner, make_batches(5))
    assert not said and not step.failed_streams
    assert runner.freed >= 1
    status = step.status
    assert status.captured and status.streams == 2 and not status.why
    assert (status.captures, status.failures, status.recovered) == (1, 1, 1)


def test_where_no_capture_succeeds_the_step_runs_eagerly_says_why_and_recapture_captures_again(monkeypatch):
    error = RuntimeError("beginAllocateToPool: already recording to mempool_id")
    runner = FailingGraphs([error] * 4)  # twice on 2 streams, twice on 1
    step, said = run(monkeypatch, runner, make_batches(4))
    assert len(runner.attempts) == 4 and step.status.mode == "eager"
    assert "already recording" in step.status.why and str(step.status).startswith("eager")
    assert any("runs eagerly" in w and "recapture()" in w for w in said)
    step.recapture()
    x, y = make_batches(1, seed=7)[0]
    step(x, y)
    assert step.status.captured and step.status.streams == 2 and len(runner.attempts) == 5


def test_a_failed_capture_is_cleaned_up_after_once_its_graph_is_gone_and_its_pool_is_not_reused(monkeypatch):
    """With torch's graph API faked: the generator leaves capture mode at once; the runner gives back a failed
    attempt (failed()) after the graph object is freed, asks torch to undo what the capture left in the pool, and
    never captures into that pool again."""
    cuda = fake_cuda(monkeypatch)
    finished = []

    def finish(device, pool):
        finished.append((pool, cuda.alive()))
        return True

    monkeypatch.setattr(graph_runner.compat, "finish_failed_capture", finish)
    generator = []
    monkeypatch.setattr(graph_runner.compat, "end_generator_capture", lambda stream: generator.append(stream))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runner = graph_runner.CudaGraphRunner(priority=False)
    first = runner._pool_handle()

    def fails():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError):
        runner.capture(fails, step=None)
    runner.failed()
    assert finished == [(first, 0)], "cleaned up once, after the failed graph was freed"
    assert len(generator) == 1, "the generator is taken out of capture mode at once"
    runner.release_old_pool()
    runner.capture(lambda: None, step=None)
    assert runner._pool_handle() != first
    runner.failed()
    assert len(finished) == 1, "a capture that succeeded needs no cleaning up"


def test_the_cyclic_collector_is_held_off_during_a_capture(monkeypatch):
    """Freeing a CUDA graph while a stream captures invalidates the capture: no collection may run inside."""
    fake_cuda(monkeypatch)
    runner = graph_runner.CudaGraphRunner(priority=False)
    seen = []
    runner.capture(lambda: seen.append(gc.isenabled()), step=None)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ValueError):
        runner.capture(lambda: (_ for _ in ()).throw(ValueError("x")), step=None)
    assert gc.isenabled(), "a failed capture must turn the collector back on"


def test_a_capture_collects_only_the_young_generations_before_it(monkeypatch):
    """A full collection walks every object of the process (a third of a second once inductor has compiled),
    and a setup captures a dozen graphs: only a failed attempt's cleanup pays for one."""
    fake_cuda(monkeypatch)
    collected = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or real_collect(0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(measure, "_FAILED_CAPTURES", [])  # none left over by an earlier test to clean up first
    runner = graph_runner.CudaGraphRunner(priority=False)
    runner.capture(lambda: None, step=None)
    runner.capture(lambda: None, step=None)
    assert collected and max(collected) < 2, f"a full collection before a capture: {collected}"
    collected.clear()
    with pytest.raises(RuntimeError):
        runner.capture(lambda: (_ for _ in ()).throw(RuntimeError("out of memory")), step=None)
    runner.failed()
    assert 2 in collected, "a failed attempt's cycles (its traceback's frames) are collected in full"


def test_status_before_the_first_call_and_without_graphs(monkeypatch):
    model = make_model()
    x, y = make_batches(1)[0]
    step = concur.train_step(model, loss_fn, SGD_M(model), (x, y), streams=2)
    assert str(step.status) == "not run yet"
    step(x, y)
    assert step.status.mode == "eager" and step.status.captures == 0  # CPU: no graphs



def test_a_capture_that_ran_out_of_memory_and_then_failed_at_its_end_is_told_as_out_of_memory(monkeypatch):
    """Out of memory mid-capture on a side stream fails the capture at its end ("capturing stream has unjoined
    work"), raised while the allocator's error is handled: the cause is memory, so no retry, and the warning says
    what was missing."""
    def unjoined():
        try:
            raise torch.OutOfMemoryError(OOM)
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: capturing stream has unjoined work")

    try:
        unjoined()
    except RuntimeError as exc:
        error = exc
    runner = FailingGraphs([error])
    step, said = run(monkeypatch, runner, make_batches(4))
    assert step.failed_streams == {2} and len(runner.attempts) == 2, "no retry of a capture out of memory"
    assert len(said) == 1 and "does not fit in memory" in said[0] and "20.00 MiB" in said[0]


def test_what_was_missing_is_read_from_the_allocators_error_else_the_error_raised():
    """The shortfall comes from the link of the chain that names the request; where none does, from the error
    raised, not from whatever it was raised while handling."""
    from concur.training.out_of_memory import shortfall

    try:
        try:
            raise ValueError("unrelated")
        except ValueError:
            raise RuntimeError("CUDA error: out of memory")
    except RuntimeError as exc:
        assert shortfall(exc) == "CUDA error: out of memory"


# --- a compiled step keeps the streams that fit: the backward graphs' programs go first ------------------------

class PlanSwitch:
    """An installed multi-stream program's switch (``InstalledPlan.use_streams``): whether it runs."""

    def __init__(self):
        self.on = True

    def __call__(self, on):
        self.on = on


class FewerStreams:
    """An installed program's re-placement on fewer streams (``InstalledPlan.fewer_streams``): the stream counts
    asked for, and the plan it returns (None: the schedule on fewer streams is not worth running)."""

    def __init__(self, worth=True):
        self.asked, self.worth = [], worth

    def __call__(self, k, lean=False):
        from concur.inductor.wrapper_emit import KernelStreamPlan

        self.asked.append((k, lean) if lean else k)
        return KernelStreamPlan((), (), num_streams=k, num_events=1, num_waits=1, num_launches=12, num_barriers=0,
                                ideal_speedup=1.5, predicted_speedup=1.2) if self.worth else None


def compiled_run(monkeypatch, runner, batches, backward_plans=True, streams=2, fewer=None):
    """A ``compile=True`` step on CPU: torch.compile stands aside (the model runs as it is) and the backend is a
    real ConcurBackend holding a forward and a backward graph, each with a multi-stream program installed (the
    backward's re-placed on fewer streams by ``fewer``, where given)."""
    from concur.inductor.placement import InstalledPlan
    from concur.inductor.stream_backend import BackendOptions, CompiledGraphInfo, ConcurBackend

    switches = {False: PlanSwitch(), True: PlanSwitch()}  # by is_backward
    made = []

    def make_backend(streams, scheduler, **options):
        backend = ConcurBackend(BackendOptions(streams=streams, scheduler=scheduler, measure=False))
        kinds = () if streams == 1 else (False, True) if backward_plans else (False,)  # streams=1: inductor's
        for record, is_backward in enumerate(kinds):
            backend.graphs.append(CompiledGraphInfo(is_backward, 12, 12, streams, 3, None))
            backend._install(record, InstalledPlan(None, None, switches[is_backward], fewer if is_backward else None))
        made.append(streams)
        return backend

    monkeypatch.setattr(train_mod, "backend", make_backend)
    monkeypatch.setattr(torch, "compile", lambda model, backend, dynamic: model)
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    model, ref = make_model(), make_model()
    opt, ref_opt = SGD_M(model), SGD_M(ref)
    step = concur.train_step(model, loss_fn, opt, batches[0], streams=streams, compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(x, y).item() for x, y in batches]
    assert_same_run(losses, plain_loop(ref, ref_opt, batches), model, ref)
    said = [str(w.message) for w in caught if "concur.train_step" in str(w.message)]
    return step, said, switches, made


def test_a_compiled_step_whose_backward_on_two_streams_still_does_not_fit_keeps_aten_on_the_caller_then_one(
        monkeypatch):
    """Two streams missed too: the backward's aten calls go to the caller's stream, inductor's kernels keep the
    side streams (no side stream allocates); that missed as well, the backward runs inductor's own call; the
    forward keeps its 4 streams throughout. Where a step's schedule is not worth running, the backward goes to
    one stream at once."""
    oom = lambda size: torch.OutOfMemoryError(OOM.replace("20.00", size))  # noqa: E731
    fewer = FewerStreams()
    runner = FailingGraphs([oom("20.00"), oom("170.00")])
    step, said, switches, made = compiled_run(monkeypatch, runner, make_batches(4), streams=4, fewer=fewer)
    assert fewer.asked == [2, (2, True)] and switches[True].on and switches[False].on and made == [4]
    (warning,) = said  # what the last attempt missed, as the status says
    assert "backward graphs run on at most 2 streams, aten's calls on the caller's" in warning
    assert "170.00 MiB" in warning and "170.00 MiB" in step.status.why and "aten's calls" in step.status.why

    fewer = FewerStreams()
    runner = FailingGraphs([oom("20.00"), oom("170.00"), oom("120.00")])
    step, said, switches, made = compiled_run(monkeypatch, runner, make_batches(4), streams=4, fewer=fewer)
    assert fewer.asked == [2, (2, True)] and not switches[True].on and switches[False].on and made == [4]
    forward, backward = step.backends[4].graphs
    assert (forward.num_streams, backward.num_streams) == (4, 1) and backward.decided_by == "memory"
    (warning,) = said
    assert "backward graphs run on 1 stream" in warning and "120.00 MiB" in warning
    assert (step.status.captures, step.status.failures) == (1, 3)

    fewer = FewerStreams(worth=False)
    runner = FailingGraphs([torch.OutOfMemoryError(OOM)])
    step, said, switches, made = compiled_run(monkeypatch, runner, make_batches(3), streams=4, fewer=fewer)
    assert fewer.asked == [2] and not switches[True].on and step.backends[4].graphs[1].num_streams == 1
    assert len(runner.attempts) == 2 and "backward graphs run on 1 stream" in said[0]


@pytest.mark.parametrize("streams, asked, backward_on", [
    (4, [2], "on at most 2 streams"),
    (2, [(2, True)], "on at most 2 streams, aten's calls on the caller's")])
def test_a_compiled_step_out_of_memory_takes_its_backward_graphs_streams_down_first(monkeypatch, streams, asked,
                                                                                   backward_on):
    """The step's peak is at the start of backward: the backward graphs' programs go first (on more than 2
    streams, their launches placed again on 2: one side stream's aten allocations and workspace beside the
    caller's; on 2, aten's calls on the caller's stream), the forward graphs keep their streams, nothing
    compiles again, and one warning says what was missing."""
    fewer = FewerStreams()
    runner = FailingGraphs([torch.OutOfMemoryError(OOM)])
    step, said, switches, made = compiled_run(monkeypatch, runner, make_batches(5), streams=streams, fewer=fewer)
    assert fewer.asked == asked and switches[False].on and switches[True].on
    assert made == [streams] and not step.failed_streams, "the same compiled module, not one compiled for 1 stream"
    forward, backward = step.backends[streams].graphs
    assert (forward.num_streams, backward.num_streams) == (streams, 2) and backward.decided_by == "memory"
    (warning,) = said
    assert f"backward graphs run {backward_on}, its forward" in warning and "20.00 MiB" in warning
    status = step.status
    assert status.captured and status.streams == streams and f"backward graphs run {backward_on}" in status.why
    assert (status.captures, status.failures) == (1, 1)


def test_a_compiled_step_that_still_does_not_fit_drops_to_one_stream_then_runs_eagerly(monkeypatch):
    """With the backward graphs on one stream it still does not fit: the module is given back and one compiled
    for one stream captures (what the 4-stream module held goes with it); where that fails too, eager."""
    runner = FailingGraphs([torch.OutOfMemoryError(OOM)] * 2)
    step, said, switches, made = compiled_run(monkeypatch, runner, make_batches(4))
    assert made == [2, 1] and step.failed_streams == {2} and 2 not in step.backends
    assert len(said) == 1 and "running it on 1 stream instead" in said[0] and "20.00 MiB" in said[0]
    assert step.status.captured and step.status.streams == 1 and (step.status.captures, step.status.failures) == (1, 2)

    runner = FailingGraphs([torch.OutOfMemoryError(OOM)] * 3)
    step, said, switches, made = compiled_run(monkeypatch, runner, make_batches(3))
    assert made == [2, 1] and len(runner.attempts) == 3 and step.status.mode == "eager"
    assert any("runs eagerly" in w for w in said)


def test_a_compiled_step_with_only_forward_graphs_on_streams_drops_to_one_stream_at_once(monkeypatch):
    """No backward graph runs on streams: switching nothing off cannot help, so there is no second attempt."""
    runner = FailingGraphs([torch.OutOfMemoryError(OOM)])
    step, said, switches, made = compiled_run(monkeypatch, runner, make_batches(3), backward_plans=False)
    assert made == [2, 1] and len(runner.attempts) == 2 and step.status.streams == 1
    assert len(said) == 1 and "running it on 1 stream instead" in said[0]


def test_narrowing_plans_for_memory_switches_off_the_backward_graphs_and_those_compiled_later():
    """What a step that does not fit in memory switches off (ConcurBackend.narrow_plans): the backward graphs'
    programs, while a forward graph keeps its streams; a backward graph compiled after (a new input shape) runs
    inductor's call at once; with no forward graph on streams, nothing (the step drops to one stream)."""
    from concur.inductor.placement import InstalledPlan
    from concur.inductor.stream_backend import BackendOptions, CompiledGraphInfo, ConcurBackend

    backend = ConcurBackend(BackendOptions(streams=3, measure=False))
    running = {}

    def install(is_backward):
        record = len(backend.graphs)
        backend.graphs.append(CompiledGraphInfo(is_backward, 9, 9, 3, 2, None))
        running[record] = True
        backend._install(record, InstalledPlan(None, None, lambda on, r=record: running.__setitem__(r, on)))
        return record

    lone_backward = install(True)
    assert not backend.narrow_plans("out of memory") and running[lone_backward], "no forward graph keeps streams"
    fwd = install(False)
    assert not backend.narrowed and backend.narrow_plans("out of memory") and backend.narrowed
    assert running == {lone_backward: False, fwd: True}
    bwd = backend.graphs[lone_backward]
    assert bwd.num_streams == 1 and bwd.one_stream_reason == "out of memory" and bwd.decided_by == "memory"
    later_fwd, later_bwd = install(False), install(True)
    assert running[later_fwd] and not running[later_bwd] and backend.graphs[later_bwd].decided_by == "memory"
    assert not backend.narrow_plans("again"), "nothing more to switch off"


def test_narrowing_plans_steps_a_backward_down_to_two_streams_then_aten_on_the_caller_then_one():
    """A backward graph on 4 streams goes to 2 (placed again, not switched off), one on 2 stays; the next step
    puts every backward's aten calls on the caller's stream (placed again on the backend's 4 streams); the next
    switches every backward graph off; a backward graph compiled after each step gets it at once."""
    from concur.inductor.placement import InstalledPlan
    from concur.inductor.stream_backend import BackendOptions, CompiledGraphInfo, ConcurBackend

    backend = ConcurBackend(BackendOptions(streams=4, measure=False))
    running, fewer = {}, {}

    def install(is_backward, streams=4):
        record = len(backend.graphs)
        backend.graphs.append(CompiledGraphInfo(is_backward, 9, 9, streams, 2, None))
        running[record], fewer[record] = True, FewerStreams()
        backend._install(record, InstalledPlan(None, None, lambda on, r=record: running.__setitem__(r, on),
                                               fewer[record]))
        return record

    fwd, wide, narrow = install(False), install(True), install(True, streams=2)
    assert backend.narrow_plans("out of memory") == "on at most 2 streams" and backend.narrowed
    assert fewer[wide].asked == [2] and fewer[narrow].asked == [] and fewer[fwd].asked == []
    assert all(running.values()) and [g.num_streams for g in backend.graphs] == [4, 2, 2]
    assert backend.graphs[wide].decided_by == "memory" and backend.graphs[narrow].decided_by == ""
    later = install(True)
    assert fewer[later].asked == [2] and backend.graphs[later].num_streams == 2
    assert backend.narrow_plans("again") == "on at most 2 streams, aten's calls on the caller's"
    assert [fewer[r].asked[-1] for r in (wide, narrow, later)] == [(2, True)] * 3 and all(running.values())
    assert install(True) and fewer[max(running)].asked == [(2, True)], "compiled after: the same step at once"
    assert backend.narrow_plans("once more") == "on 1 stream"
    assert running == {fwd: True, wide: False, narrow: False, later: False, max(running): False}
    assert backend.narrow_plans("nothing left") == ""


def test_a_backward_that_cannot_be_placed_again_goes_from_every_stream_to_one():
    """No program to place again (a graph whose own call was not found): the backward steps straight to
    inductor's call."""
    from concur.inductor.placement import InstalledPlan
    from concur.inductor.stream_backend import BackendOptions, CompiledGraphInfo, ConcurBackend

    backend = ConcurBackend(BackendOptions(streams=4, measure=False))
    running = {}
    for record, is_backward in enumerate((False, True)):
        backend.graphs.append(CompiledGraphInfo(is_backward, 9, 9, 4, 2, None))
        running[record] = True
        backend._install(record, InstalledPlan(None, None, lambda on, r=record: running.__setitem__(r, on)))
    assert backend.narrow_plans("out of memory") == "on 1 stream" and running == {0: True, 1: False}


def test_the_static_batch_is_copied_once_the_workspaces_and_the_cache_are_given_back(monkeypatch):
    """The static batch and the cuBLAS workspaces live as long as the graph. Copied while the cache holds freed
    blocks (the batch check's activations), the batch takes a piece of one and the rest of that segment stays
    reserved beside the pool, where the capture cannot have it (on the GPU, Inception-v3 b64 captured again after
    its trial began with 86 MB more reserved so, and missed 170 MiB): the workspaces and the cache go first."""
    from concur import _torch_compat as compat
    from concur.training import capture as capture_mod

    log = []

    class Logged(EmulatedGraphs):
        def empty_cache(self):
            log.append("empty_cache")

    monkeypatch.setattr(compat, "clear_cublas_workspaces", lambda: log.append("workspaces"))
    copy = capture_mod._detached_copy
    monkeypatch.setattr(capture_mod, "_detached_copy", lambda v: (log.append("copy"), copy(v))[1])
    run(monkeypatch, Logged(), make_batches(3))
    assert log[:log.index("copy")] == ["workspaces", "empty_cache"], log

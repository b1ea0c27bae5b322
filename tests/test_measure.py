"""concur.dag.measure: when programs can be timed, the inputs made for them, and (GPU) the alternating replays."""

from __future__ import annotations

import os
import re

import pytest
import torch

from concur.dag import measure
from tests.conftest import requires_cuda


def test_nothing_is_timed_on_a_cpu_or_when_switched_off(monkeypatch):
    monkeypatch.delenv(measure.ENVIRONMENT_SWITCH, raising=False)
    assert not measure.can_time(torch.device("cpu")) and not measure.can_time(None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert measure.can_time(torch.device("cuda", 0))
    monkeypatch.setenv(measure.ENVIRONMENT_SWITCH, "0")
    assert not measure.can_time(torch.device("cuda", 0))


def test_nothing_is_timed_while_a_graph_is_being_captured(monkeypatch):
    monkeypatch.delenv(measure.ENVIRONMENT_SWITCH, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not measure.can_time(torch.device("cuda", 0))


def test_real_inputs_copy_the_layout_of_fake_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = [torch.empty(4, 6).t(), torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.bool)]
        real = measure.real_inputs([*fake, 7])  # made inside the fake mode, as inductor's forward compile is
    assert [type(t) for t in real[:3]] == [torch.Tensor] * 3 and real[3] == 7
    assert real[0].shape == (6, 4) and real[0].stride() == (1, 6) and real[0].dtype == torch.float32
    assert bool(((real[0] >= 0.5) & (real[0] < 1.0)).all())  # no NaN from a square root or a log
    assert real[1].dtype == torch.int64 and not real[1].any()  # a valid index
    assert real[2].dtype == torch.bool and not real[2].any()


def test_the_environment_names_the_device_and_torch():
    name, version, _ = measure.environment(torch.device("cpu"))
    assert (name, version) == ("cpu", torch.__version__)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(measure.ENVIRONMENT_SWITCH, raising=False)
    return tmp_path


@pytest.mark.cuda
@requires_cuda
def test_alternating_replays_time_two_captured_programs():
    """A program doing twice the work measures about twice as long, in every round."""
    x = torch.randn(2048, 2048, device="cuda")

    def once():
        return x @ x

    def twice():
        return (x @ x) @ x

    rounds = measure.replay_rounds((once, twice), x.device, rounds=5, settled=None)  # every round, not settled
    assert len(rounds) == 5
    for a, b in rounds:
        assert 0 < a < b and 1.5 < b / a < 2.5, rounds


@pytest.mark.cuda
@requires_cuda
def test_boxed_timer_times_a_compiled_graph_against_its_streams(cache_dir):
    """The wrapper route's timer through a real compile: both calls run, and times come back."""
    import concur
    from concur.dag import decide
    from tests.models import WideNet

    torch._dynamo.reset()
    model = WideNet(branches=4, channels=32).cuda()
    backend = concur.backend(streams=4)
    out = torch.compile(model, backend=backend)(torch.randn(8, 3, 32, 32, device="cuda"))
    out.sum().backward()
    torch.cuda.synchronize()
    timed = [g for g in backend.graphs if g.decided_by in ("measurement", "cache")]
    assert timed, backend.graphs
    for g in timed:
        assert g.measured_speedup is not None and g.measured_speedup > 0
        assert (g.num_streams > 1) == (g.measured_speedup > 1 / (1 - decide.MARGIN)), g
    torch._dynamo.reset()


@pytest.mark.cuda
@requires_cuda
def test_optimize_times_its_plan_once_and_leaves_the_model_as_it_was(cache_dir, caplog, monkeypatch):
    """The fx path on a GPU: timed (forward and backward, captured), cached, and no state changed by it."""
    import logging

    import schedulers

    import concur
    from tests.models import WideNet

    # the prediction is made to let the plan through, so that the real timer decides
    monkeypatch.setattr(schedulers, "simulate_shared", lambda dag, s: 0.5 * sum(dag.nodes[v]["cost"] for v in dag))
    # timing takes turns with any other process on the GPU (tests side by side), so the decision is reused below
    monkeypatch.setenv(measure.ENVIRONMENT_LOCK, os.environ.get(measure.ENVIRONMENT_LOCK, str(cache_dir / "turns.lock")))

    torch.manual_seed(0)
    model = WideNet(branches=4, channels=32).cuda().train()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    model(x).sum().backward()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="concur"):
        first = concur.optimize(model, (x,), streams=4)
        second = concur.optimize(model, (x,), streams=4)
    lines = [r.getMessage() for r in caplog.records if r.name == "concur" and "concur.optimize" in r.getMessage()]
    assert len(lines) == 2 and re.search(r"median of \d+ alternating rounds", lines[0]) and "cached measurement" in lines[1], lines
    assert first.schedule.num_streams == second.schedule.num_streams
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    for k, p in model.named_parameters():
        assert torch.equal(p.grad, grads[k]), k
    torch.testing.assert_close(first(x), model(x))


def test_timing_takes_its_turn_under_the_lock_the_environment_names(tmp_path, monkeypatch):
    import fcntl

    from concur.dag.measure import ENVIRONMENT_LOCK, gpu_turn

    lock = tmp_path / "gpu.lock.measure"
    monkeypatch.setenv(ENVIRONMENT_LOCK, str(lock))
    with open(lock, "a") as other:  # another process's turn, as flock sees it: another open file
        with gpu_turn():
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the turn
    monkeypatch.delenv(ENVIRONMENT_LOCK)
    with gpu_turn():  # no lock named: nothing to take
        pass


def test_rounds_stop_once_settled_and_the_timing_memory_is_given_back(monkeypatch):
    """Faked CUDA: one stream 1.0 ms a replay, the other program 0.5 ms: clearly faster, so the timing stops after
    decide.SETTLED_ROUNDS rounds, not measure.ROUNDS; the graphs are freed before the cache is emptied."""
    from concur.dag import decide
    from tests.fake_cuda_graphs import fake_cuda

    cuda = fake_cuda(monkeypatch)
    cuda.replay_ms = lambda i: 1.0 if i == 0 else 0.5
    calls = []
    rounds = measure.alternating_replays(lambda: calls.append(1), lambda: calls.append(2), torch.device("cuda"))
    assert rounds == [(1.0, 0.5)] * decide.SETTLED_ROUNDS < [(1.0, 0.5)] * measure.ROUNDS
    assert calls == [1, 2] * measure.WARMUP + [1, 2]  # warm-up, then one call of each under capture
    assert cuda.log[-1] == ("empty_cache", 0) and cuda.alive() == 0
    cuda.replay_ms = lambda i: 1.0 if i == 0 else 0.995  # within the margin: every round is timed
    assert len(measure.alternating_replays(lambda: None, lambda: None, torch.device("cuda"))) == measure.ROUNDS


def test_slower_programs_are_replayed_fewer_times_a_round(monkeypatch):
    """Faked CUDA: a round's block of each program lasts about measure.BLOCK_MS, so a timing at batch 128 costs about
    what it costs at batch 8; one replay each first (uncounted in the rounds) says how long a program runs."""
    from tests.fake_cuda_graphs import fake_cuda

    assert measure.block_replays([0.5, 0.4]) == measure.REPLAYS  # fast programs: every replay a round allows
    assert measure.block_replays([2.6, 2.5]) == 2  # the fastest fills BLOCK_MS in two
    assert measure.block_replays([12.0, 9.0]) == 1  # never fewer than one
    assert measure.block_replays([0.0, 1.0]) == measure.REPLAYS  # nothing measured: as many as allowed
    cuda = fake_cuda(monkeypatch)
    replays = []
    cuda.replay_ms = lambda i: replays.append(i) or (8.0 if i == 0 else 6.0)
    rounds = measure.alternating_replays(lambda: None, lambda: None, torch.device("cuda"))
    assert rounds[0] == (8.0, 6.0)
    assert len(replays) == 2 + 2 * len(rounds)  # the first replay of each, then one of each per round


def test_timings_say_how_many_other_processes_shared_the_gpu_and_warn_once(monkeypatch):
    import warnings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure, "_WARNED_BESIDE", set())
    monkeypatch.delenv(measure.ENVIRONMENT_LOCK, raising=False)
    monkeypatch.setattr(measure, "other_processes_on", lambda index: 2)
    with pytest.warns(RuntimeWarning, match="beside 2 other processes on GPU 0"):
        assert measure.others_timing_beside(torch.device("cuda", 0)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device
        assert measure.others_timing_beside(torch.device("cuda", 0)) == 2
    monkeypatch.setenv(measure.ENVIRONMENT_LOCK, "/tmp/turns")  # processes that take turns said so: not counted
    assert measure.others_timing_beside(torch.device("cuda", 0)) is None
    monkeypatch.delenv(measure.ENVIRONMENT_LOCK)
    assert measure.others_timing_beside(torch.device("cpu")) is None
    assert measure.others_timing_beside(None) is None


def test_replayed_rounds_carry_the_other_processes_to_the_decision(monkeypatch):
    """Faked CUDA: what the timing saw of other processes reaches decide (which then does not reuse the decision)."""
    from concur.dag import decide
    from tests.fake_cuda_graphs import fake_cuda

    cuda = fake_cuda(monkeypatch)
    cuda.replay_ms = lambda i: 1.0 if i == 0 else 0.5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure, "_WARNED_BESIDE", {0})  # warned already
    monkeypatch.delenv(measure.ENVIRONMENT_LOCK, raising=False)
    monkeypatch.setattr(measure, "other_processes_on", lambda index: 1)
    rounds = measure.alternating_replays(lambda: None, lambda: None, torch.device("cuda", 0))
    assert isinstance(rounds, decide.TimedRounds) and rounds.others == 1 and rounds[0] == (1.0, 0.5)

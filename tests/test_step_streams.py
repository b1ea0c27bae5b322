"""The decision over the whole compiled step (concur.training.step_streams), with faked timings on CPU.

A graph may keep its multi-stream program on its own measurement and still
make the step slower; the step then times forward and backward with and
without the plans and drops them all if they do not pay. What runs is seen
through the convolution backward calls the profiler counts: a multi-stream
backward runs ConvChain's five input-and-weight calls split in two, inductor's
own program runs them joint. (A dispatch mode would not do: dynamo does not
compile under one.)
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import concur
import concur.training.step as train_mod
from tests.test_decide_routes import FASTER, SLOWER, wrapper_timing
from tests.test_step_habits import EmulatedGraphs
from tests.test_backward_split import LAUNCH_LIGHT, ConvChain

JOINT, SPLIT = 6, 11  # ConvChain's convolution_backward calls per backward: inductor's own, and split


def convolution_backward_calls(fn):
    """Return fn's result and how many convolution_backward calls it ran (as the profiler saw them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(1 for e in prof.events() if e.name == "aten::convolution_backward")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CONCUR_MEASURE", raising=False)
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()


class TimedGraphs(EmulatedGraphs):
    """The emulated runner, timing the step's two programs with fixed rounds; records what each program ran."""

    def __init__(self, rounds):
        super().__init__()
        self.rounds, self.timed, self.ran = rounds, 0, {}

    def can_time(self, device):
        return True

    def time_programs(self, one_stream, streams, device):
        self.timed += 1
        for name, program in (("one_stream", one_stream), ("streams", streams)):
            self.ran[name] = convolution_backward_calls(program)[1]
        return self.rounds


def run_steps(monkeypatch, step_rounds, graph_rounds=FASTER, steps=2):
    """Train ConvChain with train_step(compile=True) on the timed emulation; return (step, runner, losses, masks)."""
    wrapper_timing(monkeypatch, graph_rounds)  # each graph measures (faked) at its first call, with a cache key
    runner = TimedGraphs(step_rounds)
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    torch.manual_seed(0)
    model = ConvChain()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    step = concur.train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             (x, y), streams=4, compile=True, compile_options={"roofline": LAUNCH_LIGHT})
    losses, calls = [], []
    for _ in range(steps):  # the emulated graph replays by running the step's body again
        loss, n = convolution_backward_calls(lambda: step(x, y).item())
        losses.append(loss)
        calls.append(n)
    return step, runner, losses, calls[1:]  # the first call also warms up, times and captures


def plain_losses(steps=2):
    torch.manual_seed(0)
    model = ConvChain()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.inductor
def test_a_step_slower_on_streams_drops_the_plans_its_graphs_kept(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="concur"):
        step, runner, losses, ran = run_steps(monkeypatch, SLOWER)
    backend = step.backends[4]
    assert runner.timed == 1
    # the two programs timed: inductor's own backward (joint calls), and the plan's (split calls)
    assert runner.ran == {"one_stream": JOINT, "streams": SPLIT}, runner.ran
    (decision,) = step.step_decisions
    assert not decision.keep and decision.source == "measurement"
    # the backward measured faster alone (ConvChain's forward is a chain), and runs inductor's call after the step's decision
    forward, backward = backend.graphs
    assert forward.num_streams == 1 and forward.decided_by == "", forward
    assert backward.measured_speedup == pytest.approx(1.25) and backward.num_streams == 1, backward
    assert backward.decided_by == "step measurement" and backward.convolutions_split == 0, backward
    assert backward.one_stream_reason.startswith("the whole step was not faster on streams: measured 1.200 ms")
    assert not backend.installed_plans()
    assert ran == [JOINT], ran  # the step replays inductor's backward
    torch.testing.assert_close(losses, plain_losses(), rtol=1e-4, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records if "the forward and backward of ConvChain" in r.getMessage()]
    assert len(lines) == 1 and "runs on one stream: measured 1.200 ms on" in lines[0], lines
    assert "streams against 1.000 ms on one stream" in lines[0], lines


@pytest.mark.inductor
def test_a_step_faster_on_streams_keeps_them_and_a_second_setup_reads_the_cache(monkeypatch):
    step, runner, losses, ran = run_steps(monkeypatch, FASTER)
    (decision,) = step.step_decisions
    assert runner.timed == 1 and decision.keep
    assert any(g.num_streams > 1 for g in step.backends[4].graphs)
    assert ran == [SPLIT], ran  # the step replays the plan's backward
    torch.testing.assert_close(losses, plain_losses(), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    again, runner, _, _ = run_steps(monkeypatch, SLOWER)  # a new process would read the same cache
    (decision,) = again.step_decisions
    assert runner.timed == 0 and decision.keep and decision.source == "cache"


@pytest.mark.inductor
def test_without_a_timer_the_step_keeps_what_its_graphs_decided(monkeypatch):
    wrapper_timing(monkeypatch, FASTER)
    runner = EmulatedGraphs()  # can_time() is False: nothing to time the step on
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    model = ConvChain()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    step = concur.train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                             streams=4, compile=True, compile_options={"roofline": LAUNCH_LIGHT})
    step(x, y)
    assert step.step_decisions == [] and any(g.num_streams > 1 for g in step.backends[4].graphs)


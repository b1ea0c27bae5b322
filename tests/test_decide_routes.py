"""The measured decision (concur.dag.decide) through each route, the fx path and the backend's wrapper route,
streams="auto" included, on CPU with the GPU's timer faked.

:func:`concur.dag.measure.can_time` says yes and the timer runs both programs
once (so what each route hands it really runs) and returns the rounds a GPU
would have measured. Each test checks what the route keeps, that a second
setup reads the cache instead of timing, and that a new shape or dtype does
not. The real timer is tested on a GPU in tests/test_measure.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import concur
from concur.dag.cost import ROOFLINES, AnalyticCost, Roofline
from tests.models import WideNet

H100 = AnalyticCost(ROOFLINES["h100"])
SLOWER = [(1.0, 1.2)] * 5  # per round: one stream, several streams (ms)
FASTER = [(1.0, 0.8)] * 5


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CONCUR_MEASURE", raising=False)
    return tmp_path


class FakeReplays:
    """Stands in for alternating_replays (two programs) or replay_rounds (a sequence of them): runs each program
    once, returns fixed rounds (or raises ``fail``), counts its calls."""

    def __init__(self, rounds, fail: Exception | None = None):
        self.rounds, self.fail, self.calls = rounds, fail, 0

    def __call__(self, first, *rest, **kwargs):
        programs = list(first) if isinstance(first, (list, tuple)) else [first, rest[0]]
        self.calls += 1
        for program in programs:
            program()
        if self.fail is not None:
            raise self.fail
        return self.rounds


def fx_timing(monkeypatch, rounds) -> FakeReplays:
    """optimize times on CPU: its real timer and state keeping, fake replays."""
    import concur.fx.plan_timing as plan_timing
    import concur.fx.module as module

    fake = FakeReplays(rounds)
    monkeypatch.setattr(module, "can_time", lambda device: True)
    monkeypatch.setattr(module, "cuda_device", lambda model, inputs: torch.device("cpu"))
    monkeypatch.setattr(plan_timing, "replay_rounds", fake)
    return fake


def branchy() -> nn.Module:
    torch.manual_seed(0)
    return WideNet(branches=4, channels=16)


X = torch.randn(4, 3, 16, 16)


def test_fx_prediction_faster_measurement_slower_keeps_one_stream(monkeypatch):
    predicted = concur.optimize(branchy(), (X,), streams=4, cost_model=H100)
    assert predicted.schedule.num_streams > 1  # without timing, the prediction keeps the streams
    fake = fx_timing(monkeypatch, SLOWER)
    model = branchy()
    measured = concur.optimize(model, (X,), streams=4, cost_model=H100)
    assert fake.calls == 1 and measured.schedule.num_streams == 1
    torch.testing.assert_close(measured(X), model(X))


def test_fx_measured_faster_keeps_the_streams(monkeypatch):
    fake = fx_timing(monkeypatch, FASTER)
    assert concur.optimize(branchy(), (X,), streams=4, cost_model=H100).schedule.num_streams > 1
    assert fake.calls == 1


def test_fx_timing_leaves_buffers_and_gradients_as_they_were(monkeypatch):
    fx_timing(monkeypatch, SLOWER)
    model = branchy().train()
    model(X).sum().backward()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    concur.optimize(model, (X,), streams=4, cost_model=H100)  # ran forward and backward of both plans
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    for k, p in model.named_parameters():
        assert torch.equal(p.grad, grads[k]), k


def test_fx_timing_does_not_backpropagate_into_the_callers_graph(monkeypatch):
    """A plan built inside a forward gets activations with history: timing must not reach the layers before."""
    fx_timing(monkeypatch, SLOWER)
    before = nn.Conv2d(3, 3, 1)
    concur.optimize(branchy(), (before(X),), streams=4, cost_model=H100)
    assert before.weight.grad is None


def test_fx_second_setup_reads_the_cache_and_a_new_shape_or_dtype_misses_it(monkeypatch):
    fake = fx_timing(monkeypatch, SLOWER)
    concur.optimize(branchy(), (X,), streams=4, cost_model=H100)
    again = concur.optimize(branchy(), (X,), streams=4, cost_model=H100)
    assert fake.calls == 1 and again.schedule.num_streams == 1  # the cached decision, not timed again
    concur.optimize(branchy(), (torch.randn(8, 3, 16, 16),), streams=4, cost_model=H100)
    assert fake.calls == 2  # batch size
    concur.optimize(branchy().double(), (X.double(),), streams=4, cost_model=H100)
    assert fake.calls == 3  # dtype
    concur.optimize(WideNet(branches=5, channels=16), (X,), streams=4, cost_model=H100)
    assert fake.calls == 4  # model


def test_fx_measure_false_leaves_it_to_the_prediction(monkeypatch):
    fake = fx_timing(monkeypatch, SLOWER)
    assert concur.optimize(branchy(), (X,), streams=4, cost_model=H100, measure=False).schedule.num_streams > 1
    assert fake.calls == 0


def test_fx_the_environment_switch_turns_timing_off(monkeypatch):
    import concur.fx.plan_timing as plan_timing
    import concur.fx.module as module

    fake = FakeReplays(SLOWER)
    monkeypatch.setattr(module, "cuda_device", lambda model, inputs: torch.device("cuda"))
    monkeypatch.setattr(plan_timing, "replay_rounds", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("CONCUR_MEASURE", "0")
    assert concur.optimize(branchy(), (X,), streams=4, cost_model=H100).schedule.num_streams > 1
    assert fake.calls == 0


# ---------------------------------------------------------------- the wrapper route (inductor)

NO_MERGE = Roofline("slow-no-overhead", flops_per_us=1e3, bytes_per_us=1e2, kernel_overhead_us=0.0)


def wrapper_timing(monkeypatch, rounds) -> FakeReplays:
    """The backend times on CPU: at each graph's first call, on that call's inputs (first_call), with fake replays."""
    import concur.dag.measure as measure
    import concur.inductor.stream_backend as backend

    fake = FakeReplays(rounds)
    monkeypatch.setattr(backend, "can_time", lambda device: True)
    monkeypatch.setattr(measure, "replay_rounds", fake)
    return fake


def compile_and_run(model: nn.Module, x: torch.Tensor, backend) -> None:
    reference = copy.deepcopy(model)
    out = torch.compile(model, backend=backend)(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    out.sum().backward()


@pytest.mark.inductor
def test_wrapper_measurement_slower_keeps_inductors_call(monkeypatch):
    torch._dynamo.reset()
    fake = wrapper_timing(monkeypatch, SLOWER)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    compile_and_run(WideNet(branches=4, channels=4), torch.randn(2, 3, 8, 8), backend)
    timed = [g for g in backend.graphs if g.decided_by == "measurement"]
    assert timed and fake.calls == len(timed), backend.graphs
    assert all(g.predicted_speedup >= 1.0 - 1e-9 for g in timed)  # the prediction alone keeps the streams
    assert all(g.num_streams == 1 and "measured 1.200 ms" in g.one_stream_reason
               and g.measured_speedup == pytest.approx(1 / 1.2) for g in timed), backend.graphs
    assert all(g.num_streams == 1 for g in backend.graphs)
    torch._dynamo.reset()


@pytest.mark.inductor
def test_wrapper_measured_faster_installs_and_a_second_compile_reads_the_cache(monkeypatch):
    torch._dynamo.reset()
    fake = wrapper_timing(monkeypatch, FASTER)
    first = concur.backend(streams=4, roofline=NO_MERGE)
    compile_and_run(WideNet(branches=4, channels=4), torch.randn(2, 3, 8, 8), first)
    timed = fake.calls
    assert timed >= 1 and any(g.num_streams > 1 and g.decided_by == "measurement" for g in first.graphs)
    torch._dynamo.reset()
    second = concur.backend(streams=4, roofline=NO_MERGE)
    compile_and_run(WideNet(branches=4, channels=4), torch.randn(2, 3, 8, 8), second)
    assert fake.calls == timed and any(g.num_streams > 1 and g.decided_by == "cache" for g in second.graphs)
    torch._dynamo.reset()
    third = concur.backend(streams=4, roofline=NO_MERGE)
    compile_and_run(WideNet(branches=4, channels=4), torch.randn(3, 3, 8, 8), third)  # another batch size
    assert fake.calls > timed
    torch._dynamo.reset()


class FakeCandidateReplays:
    """replay_rounds of one stream and N candidates: one stream 1.0 ms, candidate j ``times(j, N)`` ms."""

    def __init__(self, times):
        self.times, self.widths = times, []

    def __call__(self, programs, *args, **kwargs):
        for program in programs:
            program()
        n = len(programs) - 1
        self.widths.append(n)
        return [(1.0, *[self.times(j, n) for j in range(n)])] * 5


def auto_compiled(monkeypatch, times, batch: int = 2) -> tuple:
    import concur.dag.measure as measure
    import concur.inductor.stream_backend as backend_module

    torch._dynamo.reset()
    fake = FakeCandidateReplays(times)
    monkeypatch.setattr(backend_module, "can_time", lambda device: True)
    monkeypatch.setattr(measure, "replay_rounds", fake)
    compiles: list = []
    real = backend_module.compat.inductor_compile_graph
    monkeypatch.setattr(backend_module.compat, "inductor_compile_graph",
                        lambda *a, **k: compiles.append(1) or real(*a, **k))
    backend = concur.backend(streams="auto", roofline=NO_MERGE)
    compile_and_run(WideNet(branches=4, channels=4), torch.randn(batch, 3, 8, 8), backend)
    torch._dynamo.reset()
    return backend, fake, compiles


@pytest.mark.inductor
def test_auto_times_every_stream_count_of_one_compile_and_keeps_the_fastest(monkeypatch):
    # the last candidate (the most streams) measures fastest, the others barely beat one stream
    backend, fake, compiles = auto_compiled(monkeypatch, lambda j, n: 0.5 if j == n - 1 else 0.95)
    assert len(compiles) == 2 and len(backend.graphs) == 2  # one compile per graph, forward and backward
    assert fake.widths and max(fake.widths) >= 2, fake.widths  # several stream counts timed in one call
    timed = [g for g in backend.graphs if g.decided_by == "measurement"]
    assert timed and all(g.measured_speedup == pytest.approx(2.0) for g in timed), backend.graphs
    most = [g.num_streams for g, n in zip(timed, fake.widths)]
    assert max(most) >= 3, backend.graphs


@pytest.mark.inductor
def test_auto_takes_the_fewest_streams_as_fast_as_the_fastest(monkeypatch):
    backend, fake, _ = auto_compiled(monkeypatch, lambda j, n: 0.5)  # every candidate as fast
    timed = [g for g in backend.graphs if g.decided_by == "measurement"]
    assert timed and all(g.num_streams == 2 for g in timed), backend.graphs
    slower, fake, _ = auto_compiled(monkeypatch, lambda j, n: 1.5, batch=3)  # none beats one stream
    assert all(g.num_streams == 1 for g in slower.graphs), slower.graphs


def test_backend_streams_must_be_a_count_or_auto():
    with pytest.raises(ValueError, match="'auto'"):
        concur.backend(streams="fast")
    assert concur.backend(streams="auto").options.streams == "auto"


def test_fx_auto_times_the_plans_of_one_trace_and_keeps_the_fastest(monkeypatch):
    import concur.fx.plan_timing as plan_timing
    import concur.fx.module as module

    fake = FakeCandidateReplays(lambda j, n: 0.5 if j == n - 1 else 0.9)  # the most streams measure fastest
    monkeypatch.setattr(module, "can_time", lambda device: True)
    monkeypatch.setattr(module, "cuda_device", lambda model, inputs: torch.device("cpu"))
    monkeypatch.setattr(plan_timing, "replay_rounds", fake)
    traces: list = []
    real = module.analyse
    monkeypatch.setattr(module, "analyse", lambda *a, **k: traces.append(1) or real(*a, **k))
    model = branchy()
    plan = concur.optimize(model, (X,), streams="auto", cost_model=H100).plan
    assert len(traces) == 1 and fake.widths and fake.widths[0] >= 2, (traces, fake.widths)
    assert plan.schedule.num_streams >= 3, plan.schedule.num_streams
    same = FakeCandidateReplays(lambda j, n: 0.5)  # all as fast: the fewest streams
    monkeypatch.setattr(plan_timing, "replay_rounds", same)
    assert concur.optimize(branchy(), (X[:1],), streams="auto", cost_model=H100).plan.schedule.num_streams == 2

"""A graph's streams decided at its first call, timed on that call's inputs (concur.inductor.first_call).

The timer is faked as in tests/test_decide_routes.py: ``alternating_replays``
runs each program once (so what would be replayed really runs, writing what it
writes) and returns fixed rounds. The unit tests drive :class:`FirstCall` with
small Python programs that do what inductor's calls do (empty their argument
list, mutate an input, overwrite a donated one, draw random numbers); the
inductor-tier tests compile real models through the backend.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import concur
from concur import _torch_compat as compat
from concur.dag import decide
from concur.dag.cost import Roofline
from concur.inductor import first_call
from concur.inductor.first_call import FirstCall, FirstCallTiming
from tests.models import DropoutBranches, WideNet
# the same faked timer, rounds and decision cache as the other routes' tests (cache_dir is an autouse fixture)
from tests.test_decide_routes import FASTER, SLOWER, FakeReplays, cache_dir  # noqa: F401

KEEPS = decide.Prediction(num_streams=2, serial_us=10.0, ideal_us=5.0, streams_us=6.0)  # the prediction keeps it


def fake_replays(monkeypatch, rounds, fail: Exception | None = None) -> FakeReplays:
    import concur.dag.measure as measure

    fake = FakeReplays(rounds, fail)
    monkeypatch.setattr(measure, "replay_rounds", fake)
    return fake


def no_fabrication(monkeypatch) -> list[int]:
    """Count the elements of every tensor made up for timing (the first call's and the compile-time timer's)."""
    import concur.dag.measure as measure

    made: list[int] = []
    real = measure.real_inputs

    def counting(example_inputs):
        out = real(example_inputs)
        made.extend(t.numel() for t in out if isinstance(t, torch.Tensor))
        return out

    monkeypatch.setattr(measure, "real_inputs", counting)
    monkeypatch.setattr(first_call, "real_inputs", counting)
    return made


# ---------------------------------------------------------------- FirstCall on small programs


class Program:
    """A boxed call like inductor's: empties its list, then runs ``body`` on the inputs; records what it saw."""

    def __init__(self, body):
        self.body, self.seen = body, []

    def __call__(self, args: list):
        inputs = list(args)
        args.clear()
        self.seen.append(inputs)
        return self.body(*inputs)


def deciding(own, streams, mutated=frozenset(), written=frozenset(), num_inputs=2, can_time=True):
    """A FirstCall deciding through decide.decide with a prediction that keeps the streams; returns it and its log."""
    log: dict = {"decisions": [], "installed": []}

    def settle(timer):
        decision = decide.decide("a graph", KEEPS, timer=timer)
        call = streams if decision.keep else own
        log["decisions"].append(decision)
        log["installed"].append(call)
        return call

    timing = FirstCallTiming(torch.device("cpu"), lambda: can_time)
    return FirstCall(own, [streams], settle, timing, frozenset(mutated), written, num_inputs), log


def mutating(x, stat):  # a training forward: reads x, updates a running statistic in place
    stat.add_(1.0)
    return (x * 2.0,)


def test_time_first_restores_mutated_inputs_and_runs_the_chosen_program(monkeypatch):
    fake = fake_replays(monkeypatch, FASTER)
    own, streams = Program(mutating), Program(mutating)
    call, log = deciding(own, streams, mutated={1}, written=frozenset({1}))
    x, stat = torch.randn(3), torch.zeros(())
    args = [x, stat]
    (out,) = call(args)
    assert fake.calls == 1 and args == []
    assert stat.item() == 1.0  # the timing's two updates were put back; the real call's stands
    torch.testing.assert_close(out, x * 2.0)
    assert [d.source for d in log["decisions"]] == ["measurement"] and log["installed"] == [streams]
    assert len(own.seen) == 1 and len(streams.seen) == 2  # timed once each; the real result is the chosen program's
    assert own.seen[0][0] is x and own.seen[0][1] is stat  # timed on the call's own inputs, nothing made up


def test_without_restoring_the_statistics_would_count_the_timing(monkeypatch):
    """The same call with ``mutated`` empty: the timing's updates stay (what the restore prevents)."""
    fake_replays(monkeypatch, FASTER)
    call, _ = deciding(Program(mutating), Program(mutating), mutated=frozenset(), written=None)
    stat = torch.zeros(())
    call([torch.randn(3), stat])
    assert stat.item() == 3.0


def donating(x, saved):  # a backward: overwrites a donated saved activation in place and returns it
    saved.mul_(2.0)
    return (saved + 0.0 * x, saved)


def test_real_call_first_where_the_call_overwrites_an_input_it_does_not_restore(monkeypatch):
    fake_replays(monkeypatch, FASTER)
    made = no_fabrication(monkeypatch)
    own, streams = Program(donating), Program(donating)
    call, log = deciding(own, streams, written=frozenset({1}))
    saved = torch.ones(4)
    out, same = call([torch.zeros(4), saved])
    # the real call ran first, on the real values: one doubling, whatever timing did afterwards
    torch.testing.assert_close(out, torch.full((4,), 2.0))
    assert same is saved and torch.equal(same, torch.full((4,), 2.0))  # an output in the donated memory: untouched
    assert own.seen[0][1] is saved  # the real call got the real tensor
    assert own.seen[1][1] is not saved and streams.seen[0][1] is not saved  # timing: a made-up one in its place
    assert made == [4]
    assert log["installed"] == [streams]


def test_a_donated_input_no_output_lives_in_is_timed_as_the_call_left_it(monkeypatch):
    fake_replays(monkeypatch, SLOWER)
    made = no_fabrication(monkeypatch)

    def body(x, saved):
        saved.mul_(2.0)
        return (saved.sum() + x,)

    own, streams = Program(body), Program(body)
    call, log = deciding(own, streams, written=frozenset({1}))
    saved, x = torch.ones(4), torch.zeros(())
    (out,) = call([x, saved])
    assert out.item() == 8.0
    assert own.seen[1][1] is saved and streams.seen[0][1] is saved and made == []
    assert log["installed"] == [own]


def test_an_overwritten_integer_input_is_timed_on_zeros(monkeypatch):
    """Garbage left in an index by the real call could index out of bounds: timing gets zeros instead."""
    fake_replays(monkeypatch, FASTER)

    def body(table, index):
        picked = table[index]
        index.add_(100)  # donated: the call reuses its memory
        return (picked,)

    own, streams = Program(body), Program(body)
    call, _ = deciding(own, streams, written=frozenset({1}))
    table, index = torch.arange(5.0), torch.tensor([1, 3])
    (out,) = call([table, index])
    assert torch.equal(out, torch.tensor([1.0, 3.0]))
    assert own.seen[1][1] is not index and not own.seen[1][1].is_floating_point()


def test_inputs_the_wrapper_was_not_read_for_count_as_written(monkeypatch):
    fake_replays(monkeypatch, FASTER)
    own, streams = Program(donating), Program(donating)
    call, _ = deciding(own, streams, written=frozenset(), num_inputs=3)  # read for three inputs, called with two
    saved = torch.ones(4)
    _, same = call([torch.zeros(4), saved])
    assert own.seen[0][1] is saved and torch.equal(same, torch.full((4,), 2.0))


def test_no_timing_possible_leaves_it_to_the_prediction(monkeypatch):
    fake = fake_replays(monkeypatch, SLOWER)
    own, streams = Program(mutating), Program(mutating)
    call, log = deciding(own, streams, mutated={1}, written=frozenset({1}), can_time=False)
    stat = torch.zeros(())
    call([torch.randn(3), stat])
    assert fake.calls == 0 and stat.item() == 1.0
    (decision,) = log["decisions"]
    assert decision.source == "prediction" and "CUDA graph was being captured" in decision.reason
    assert log["installed"] == [streams]


@pytest.mark.parametrize("written", [frozenset({1}), frozenset({0})], ids=["time-first", "real-call-first"])
def test_a_failed_timing_leaves_it_to_the_prediction_and_puts_everything_back(monkeypatch, written):
    fake_replays(monkeypatch, FASTER, fail=RuntimeError("capture failed"))
    own, streams = Program(mutating), Program(mutating)
    call, log = deciding(own, streams, mutated={1}, written=written)
    x, stat = torch.randn(3), torch.zeros(())
    (out,) = call([x, stat])
    torch.testing.assert_close(out, x * 2.0)
    assert stat.item() == 1.0
    (decision,) = log["decisions"]
    assert decision.source == "prediction" and "timing failed (RuntimeError: capture failed)" in decision.reason


def drawing(x, stat):
    stat.add_(1.0)
    return (x + torch.rand(3),)


@pytest.mark.parametrize("written", [frozenset({1}), frozenset({0})], ids=["time-first", "real-call-first"])
def test_random_numbers_are_those_of_a_run_without_timing(monkeypatch, written):
    fake_replays(monkeypatch, FASTER)
    x = torch.zeros(3)
    torch.manual_seed(0)
    (untimed,) = drawing(x, torch.zeros(()))
    after_untimed = torch.rand(2)
    call, _ = deciding(Program(drawing), Program(drawing), mutated={1}, written=written)
    torch.manual_seed(0)
    (out,) = call([x, torch.zeros(())])
    assert torch.equal(out, untimed) and torch.equal(torch.rand(2), after_untimed)


# ---------------------------------------------------------------- what the wrapper writes, and torch says it mutates

# the small graph on every torch and device, and GoogLeNet as the H100 compiled it (torch 2.11)
WRAPPERS = [p for p in sorted((Path(__file__).parent / "fixtures" / "wrappers").glob("*/*"))
            if (p / "wrapper.py.gz").exists()
            and (p.name.startswith("branchy_fp32") or p.parent.name.endswith("-cuda") and "googlenet_fp32" in p.name)]


@pytest.mark.parametrize("path", WRAPPERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_written_inputs_are_those_inductor_mutates_or_reuses(path):
    """Checked against inductor's scheduler (the oracle's mutations) and its reuse lines naming an input.

    A forward writes exactly the inputs it mutates (so it is timed before its
    real call), a backward those and the donated buffers it reuses.
    """
    from concur.inductor.wrapper_emit import written_inputs
    from concur.inductor.wrapper_parse import parse_wrapper_source

    source = gzip.open(path / "wrapper.py.gz", "rt").read()
    program = parse_wrapper_source(source)
    inputs = set(program.inputs)
    mutated = {m for record in json.load(gzip.open(path / "oracle.json.gz", "rt"))
               for node in record["nodes"] for m in node.get("mutations", ())} & inputs
    reused = set(re.findall(r"^\s*\w+ = (\w+); del \1\s+# reuse", source, re.M)) & inputs
    written = {program.inputs[i] for i in written_inputs(program)}
    assert written == mutated | reused
    if path.name.endswith("_fwd"):
        assert mutated and not reused


def test_mutated_inputs_read_from_a_compiled_graph():
    class Compiled:
        pass

    graph = Compiled()
    assert compat.inductor_mutated_inputs(graph) is None  # not said: fail closed
    graph.mutated_input_idxs = {3, 1}
    assert compat.inductor_mutated_inputs(graph) == frozenset({1, 3})
    for odd in (["a"], [True], [-1], "12", 5):
        graph.mutated_input_idxs = odd
        assert compat.inductor_mutated_inputs(graph) is None, odd


# ---------------------------------------------------------------- through the backend (inductor)

NO_MERGE = Roofline("slow-no-overhead", flops_per_us=1e3, bytes_per_us=1e2, kernel_overhead_us=0.0)


def backend_timing(monkeypatch, rounds) -> FakeReplays:
    import concur.inductor.stream_backend as backend

    monkeypatch.setattr(backend, "can_time", lambda device: True)
    return fake_replays(monkeypatch, rounds)


def count_first_calls(monkeypatch) -> list[FirstCall]:
    called: list[FirstCall] = []
    real = FirstCall.__call__

    def counting(self, args):
        called.append(self)
        return real(self, args)

    monkeypatch.setattr(FirstCall, "__call__", counting)
    return called


def train_steps(model: nn.Module, backend, x: torch.Tensor, steps: int = 1) -> tuple[list, list]:
    """Run compiled training steps; return the first step's output and gradients."""
    compiled = torch.compile(model, backend=backend)
    first = None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.sum().backward()
        if first is None:
            first = (out.detach().clone(), [p.grad.clone() for p in model.parameters()])
    return first


def wide() -> nn.Module:
    torch.manual_seed(0)
    return WideNet(branches=4, channels=4).train()


X = torch.randn(2, 3, 8, 8)


@pytest.mark.inductor
@pytest.mark.parametrize("rounds", [FASTER, SLOWER], ids=["streams-kept", "one-stream-kept"])
def test_the_first_call_returns_what_inductors_own_call_returns(monkeypatch, rounds):
    torch._dynamo.reset()
    reference = wide()
    expected_out, expected_grads = train_steps(reference, "inductor", X)
    torch._dynamo.reset()
    backend_timing(monkeypatch, rounds)
    model = wide()
    out, grads = train_steps(model, concur.backend(streams=4, roofline=NO_MERGE), X)
    torch.testing.assert_close(out, expected_out)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)
    for b, e in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(b, e)
    torch._dynamo.reset()


@pytest.mark.inductor
def test_the_wrapper_decides_at_the_first_call_on_its_inputs_and_then_runs_the_choice(monkeypatch):
    torch._dynamo.reset()
    fake = backend_timing(monkeypatch, FASTER)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    model = wide()
    seen: list = []
    timed = fake.__call__

    def recording(programs, device, *args, **kwargs):  # what the records said when timing began
        seen.append([g.decided_by for g in backend.graphs])
        return timed(programs, device, *args, **kwargs)

    import concur.dag.measure as measure
    monkeypatch.setattr(measure, "replay_rounds", recording)
    calls = count_first_calls(monkeypatch)
    train_steps(model, backend, X, steps=3)
    assert seen == [["pending"], ["measurement", "pending"]]  # compiled, recorded, then timed at the first call
    assert len(calls) == 2 and fake.calls == 2  # one first call per graph; later steps go straight to the choice
    assert all(g.decided_by == "measurement" and g.num_streams > 1 for g in backend.graphs), backend.graphs
    torch._dynamo.reset()


@pytest.mark.inductor
def test_timing_is_on_the_real_parameters_and_nothing_input_sized_is_made_up(monkeypatch):
    torch._dynamo.reset()
    backend_timing(monkeypatch, FASTER)
    made = no_fabrication(monkeypatch)
    seen: list = []
    import concur.dag.measure as measure
    real = measure.boxed_rounds

    def recording(programs, args, device, restore=frozenset()):
        seen.append({x.data_ptr() for x in args if isinstance(x, torch.Tensor)})
        return real(programs, args, device, restore)

    monkeypatch.setattr(first_call, "boxed_rounds", recording)
    model = wide()
    params = {p.data_ptr() for p in model.parameters()}
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    train_steps(model, backend, X)
    assert len(seen) == 2 and params <= seen[0]  # the forward is timed on the model's own parameters
    assert made == []  # neither the forward nor the backward made up an input
    assert [g.decided_by for g in backend.graphs] == ["measurement", "measurement"]
    torch._dynamo.reset()


@pytest.mark.inductor
def test_batchnorm_statistics_are_those_of_a_run_without_measurement(monkeypatch):
    torch._dynamo.reset()
    unmeasured = wide()
    train_steps(unmeasured, concur.backend(streams=4, roofline=NO_MERGE, measure=False), X)
    torch._dynamo.reset()
    fake = backend_timing(monkeypatch, SLOWER)
    measured = wide()
    train_steps(measured, concur.backend(streams=4, roofline=NO_MERGE), X)
    assert fake.calls == 2
    stats = dict(measured.named_buffers())
    assert any(k.endswith("num_batches_tracked") for k in stats)
    for name, value in unmeasured.named_buffers():
        torch.testing.assert_close(stats[name], value, rtol=0, atol=1e-6, msg=name)
    torch._dynamo.reset()


@pytest.mark.inductor
def test_random_numbers_after_the_first_step_are_those_of_a_run_without_measurement(monkeypatch):
    def step(measure: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = DropoutBranches().train()
        x = torch.randn(4, 16)
        out = torch.compile(model, backend=concur.backend(streams=4, roofline=NO_MERGE, measure=measure))(x)
        out.sum().backward()
        return out.detach(), torch.get_rng_state()

    out, state = step(measure=False)
    fake = backend_timing(monkeypatch, FASTER)
    measured_out, measured_state = step(measure=True)
    assert fake.calls >= 1
    assert torch.equal(measured_out, out) and torch.equal(measured_state, state)
    torch._dynamo.reset()


@pytest.mark.inductor
def test_a_cached_decision_is_installed_at_compile_time(monkeypatch):
    torch._dynamo.reset()
    fake = backend_timing(monkeypatch, FASTER)
    train_steps(wide(), concur.backend(streams=4, roofline=NO_MERGE), X)
    timed = fake.calls
    torch._dynamo.reset()
    calls = count_first_calls(monkeypatch)
    second = concur.backend(streams=4, roofline=NO_MERGE)
    train_steps(wide(), second, X)
    assert fake.calls == timed and calls == []  # no deciding call was installed: the cache decided at compile time
    assert [g.decided_by for g in second.graphs] == ["cache", "cache"]
    assert all(g.num_streams > 1 for g in second.graphs)
    torch._dynamo.reset()


@pytest.mark.inductor
def test_a_graph_whose_mutations_torch_does_not_state_is_timed_at_compile_time_on_made_up_inputs(monkeypatch):
    torch._dynamo.reset()
    fake = backend_timing(monkeypatch, FASTER)
    made = no_fabrication(monkeypatch)
    monkeypatch.setattr(compat, "inductor_mutated_inputs", lambda compiled: None)
    calls = count_first_calls(monkeypatch)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    train_steps(wide(), backend, X)
    assert calls == [] and fake.calls == 2 and made  # as before first-call timing: fabricated inputs
    assert [g.decided_by for g in backend.graphs] == ["measurement", "measurement"]
    torch._dynamo.reset()

"""concur.caller_memory and a StreamRuntime with caller memory, on the CPU with torch.cuda's streams faked: the ops
of a side stream go on that stream below autograd while torch's current stream stays the caller's (so autograd
records the caller's for every node), the results and gradients are the plain ones, and a side stream waits for
the caller's before writing a block the caller's stream handed out, unless it already waited after everything
the caller's stream was given."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

from concur import caller_memory, streams as runtime_module
from concur.caller_memory import CallerMemory
from concur.streams import StreamRuntime


class FakeStream:
    def __init__(self, name: str, log: list | None = None):
        self.name, self.log = name, log if log is not None else []

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


class FakeEvent:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record(self, stream) -> None:
        self.log.append(f"record {self.name} on {stream.name}")


@pytest.fixture
def streams(monkeypatch):
    """A caller's and a side stream, torch.cuda's current stream stood in for; ops 'launched' on a stream logged."""
    log: list = []
    caller, side = FakeStream("caller", log), FakeStream("side", log)
    current = [caller]

    @contextlib.contextmanager
    def on(stream):
        before, current[0] = current[0], stream
        log.append(f"launch on {stream.name}")
        try:
            yield
        finally:
            current[0] = before
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    return caller, side, log, current


def test_side_stream_ops_launch_below_autograd_with_the_plain_results_and_gradients(streams):
    caller, side, log, current = streams
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    plain = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8)
    mode = CallerMemory(caller)
    with mode:
        mode.launch = side
        out = net(x)
        assert current[0] is caller  # autograd recorded its nodes with the caller's stream current
    out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), plain.parameters()))
    assert mode.launched > 0 and log.count("launch on side") == mode.launched
    assert mode.moved == 0  # CPU tensors: the handlers move CUDA outputs only


def test_on_the_callers_stream_the_mode_launches_nothing_elsewhere(streams):
    caller, side, log, _ = streams
    mode, a = CallerMemory(caller), torch.ones(3)
    with mode:
        a + 1
        mode.launch = caller
        a * 2
    assert mode.launched == 0 and not log


def test_a_side_stream_waits_for_the_callers_once_per_op_after_all_its_outputs_are_made(streams, monkeypatch):
    """An output made on the caller's stream may take a block the caller's queued work frees: the side stream waits
    before writing it, once per op, after the op's last output is allocated (the CUDA sanitizer counts an
    allocation as a write on the caller's stream); an op whose outputs stay its own does not wait."""
    caller, side, log, _ = streams
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(f"kept for {s.name}"))

    def two_outputs(mode, args):
        outs = [mode.output((2,), torch.float32, torch.device("cpu"), torch.contiguous_format) for _ in range(2)]
        return lambda: (outs[0].copy_(torch.stack(args[0]).flatten()), outs[1])[0]

    monkeypatch.setitem(caller_memory._HANDLERS, torch.ops.aten.cat.default, two_outputs)
    mode = CallerMemory(caller)
    with mode:
        mode.launch = side
        for _ in range(2):
            torch.cat([torch.ones(1), torch.ones(1)])
        torch.ones(2).add(1)  # no handler: its output the side stream's, no wait
    waits = [e for e in log if not e.startswith("launch")]
    assert waits == ["kept for side", "kept for side", "side waits for caller"] * 2 and mode.moved == 4


def test_a_handler_that_cannot_read_its_call_leaves_the_op_as_it_is(streams, monkeypatch):
    caller, side, log, _ = streams

    def unreadable(mode, args):
        raise RuntimeError("no meta kernel")
    monkeypatch.setitem(caller_memory._HANDLERS, torch.ops.aten.cat.default, unreadable)
    mode, parts = CallerMemory(caller), [torch.ones(2), torch.zeros(2)]
    with mode:
        mode.launch = side
        out = torch.cat(parts)
    assert torch.equal(out, torch.tensor([1.0, 1.0, 0.0, 0.0])) and mode.moved == 0 and mode.launched == 1


@pytest.fixture
def runtime(streams, monkeypatch):
    """A 2-stream runtime with caller memory, bound to the fake streams."""
    caller, side, log, current = streams
    rt = StreamRuntime(num_streams=2, num_events=1, weight_grad_stream=True, caller_memory=True)
    rt._device, rt._side, rt._events = "cuda:0", [side], [FakeEvent("e0", log)]
    rt._join_events, rt._weight_grad = [FakeEvent("j0", log), FakeEvent("j1", log)], FakeStream("w", log)
    monkeypatch.setattr(runtime_module, "cuda_device_in", lambda *values: "cuda:0")
    monkeypatch.setattr(runtime_module, "tensors_in", lambda value: [])
    return rt, caller, side, log, current


def test_a_runtime_with_caller_memory_launches_side_ops_from_its_mode_and_keeps_the_callers_stream(runtime):
    rt, caller, side, log, current = runtime
    rt.fork("x")
    mode = rt._mode
    assert isinstance(mode, CallerMemory) and mode.caller is caller
    rt.switch(1)
    assert current[0] is caller and mode.launch is side  # autograd records the caller's stream
    rt.wait(0)  # on the side stream: not the caller's work
    rt.switch(0)
    rt.wait(0)
    assert mode.launch is caller
    rt.switch(1)
    with rt.on_weight_grad_stream():
        assert current[0].name == "w"
    assert current[0] is caller  # back to the caller's, not the plan's current side stream
    rt.join("out")
    assert rt._mode is None and current[0] is caller and torch.ones(1).add(1).item() == 2  # the mode was left


def test_without_grad_or_after_an_exception_the_runtime_holds_no_mode(runtime):
    rt, caller, _, log, current = runtime
    with torch.no_grad():
        rt.fork("x")  # inference: no backward to move, the plain program
    assert rt._mode is None
    rt.join("out")
    rt.fork("x")
    rt.switch(1)
    del log[:]
    rt.abort()
    assert rt._mode is None and current[0] is caller and rt._current == 0
    # what handles the exception on the caller's stream comes after the side streams' queued work
    assert log == ["record j1 on side", "caller waits for j1"]


def test_an_abort_inside_a_capture_the_error_invalidated_still_restores_the_callers_stream(runtime, monkeypatch):
    rt, caller, _, _, current = runtime
    rt.fork("x")
    rt.switch(1)

    def refused(stream):
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    monkeypatch.setattr(rt._join_events[1], "record", refused)
    rt.abort()  # the error being handled is the one raised, not this one
    assert current[0] is caller and rt._current == 0 and rt._mode is None


def test_a_fork_after_a_call_that_never_joined_leaves_that_calls_mode(runtime):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    rt = runtime[0]
    rt.fork("x")
    rt.fork("x")  # the first call neither joined nor aborted
    assert [type(m) for m in _get_current_dispatch_mode_stack()] == [CallerMemory]
    rt.join("out")
    assert _get_current_dispatch_mode_stack() == []


def test_cudnns_batch_norm_has_no_handler():
    """Its out= variant gives its reserve back as a new tensor, which torch 2.11 cannot return through a dispatch
    mode; _batch_norm_with_update's kernel calls it where cuDNN serves the call."""
    handled = set(caller_memory._HANDLERS)
    assert torch.ops.aten.cudnn_batch_norm.default not in handled
    assert torch.ops.aten._batch_norm_with_update.default not in handled
    assert torch.ops.aten.native_batch_norm.default in handled


def test_a_plan_with_caller_memory_has_the_same_outputs_and_gradients_on_the_cpu():
    """On the CPU the runtime is inert: the option changes nothing but the plan's runtime."""
    import concur
    from tests.models import WideNet

    torch.manual_seed(0)
    model = WideNet(branches=4).double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    optimized = concur.optimize(model, (x,), streams=4, caller_memory=True)
    assert optimized.plan.runtime.caller_memory and optimized.schedule.num_streams > 1
    assert not concur.optimize(copy.deepcopy(reference), (x,), streams=1, caller_memory=True).plan.runtime.caller_memory
    optimized(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0)

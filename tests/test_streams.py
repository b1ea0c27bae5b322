"""concur.streams.StreamRuntime: inert on CPU; on CUDA (faked here) the calls it makes for fork, waits and join."""

from __future__ import annotations

import pytest
import torch

from concur import streams as runtime_module
from concur.streams import StreamRuntime


def test_on_cpu_every_call_is_a_no_op_and_the_plan_runs_in_issue_order():
    rt = StreamRuntime(num_streams=3, num_events=2)
    x = torch.randn(4)
    rt.fork(x)
    assert rt.active is False
    rt.switch(2)
    rt.record(1)
    rt.wait(0)
    rt.keep(x)
    rt.join(x)
    rt.abort()
    assert rt._current == 0 and rt._streams == [] and rt._events == []  # nothing was bound


def test_a_serial_plan_stays_inactive_even_on_cuda_inputs():
    rt = StreamRuntime(num_streams=1, num_events=0)
    rt.fork(torch.empty(0, device="meta"))  # no CUDA tensor at all
    assert rt.active is False


def test_a_serial_plan_with_a_weight_gradient_stream_is_active_on_cuda(fake_cuda):
    """A one-stream plan that splits weight gradients (concur.fx.plan.SERIAL_WEIGHT_GRADS) has no side stream,
    but its weight-gradient nodes must be recorded on their stream: the runtime is active for them."""
    _, log, current = fake_cuda
    rt = StreamRuntime(num_streams=1, num_events=0, weight_grad_stream=True)
    rt._device, rt._side, rt._events = "cuda:0", [], []
    rt._join_events, rt._weight_grad = [FakeEvent("j0", log)], FakeStream("w")
    rt.fork("x")
    assert rt.active
    with rt.on_weight_grad_stream():
        assert current[0].name == "w"
    assert current[0].name == "caller"
    rt.join("out")
    assert current[0].name == "caller" and rt._streams[0].waited == []  # no side stream to wait for
    serial = StreamRuntime(num_streams=1, num_events=0)
    serial._device = "cuda:0"
    serial.fork("x")
    assert not serial.active  # without that stream a serial plan stays the model's own program


class FakeStream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_event(self, event):
        self.waited.append(event.name)

    def __repr__(self):
        return self.name


class FakeEvent:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, stream):
        self.log.append(f"record {self.name} on {stream.name}")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A StreamRuntime bound to fake streams and events; returns (runtime, log of records, caller stream)."""
    log, caller = [], FakeStream("caller")
    current = [caller]
    rt = StreamRuntime(num_streams=3, num_events=2)
    rt._device = "cuda:0"  # already bound: _bind returns at once
    rt._side = [FakeStream("s1"), FakeStream("s2")]
    rt._events = [FakeEvent(f"e{i}", log) for i in range(2)]
    rt._join_events = [FakeEvent(f"j{i}", log) for i in range(3)]
    monkeypatch.setattr(runtime_module, "tensors_in", lambda value: [FakeTensor(log)])
    monkeypatch.setattr(runtime_module, "cuda_device_in", lambda *values: FakeTensor.device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    return rt, log, current


class FakeTensor:
    is_cuda = True
    device = "cuda:0"

    def __init__(self, log):
        self.log = log

    def record_stream(self, stream):
        self.log.append(f"keep on {stream.name}")


def test_fork_waits_side_streams_on_the_caller_and_join_waits_the_caller_on_them(fake_cuda):
    rt, log, current = fake_cuda
    rt.fork("x")
    assert rt.active and log == ["record j0 on caller"]
    assert [s.waited for s in rt._side] == [["j0"], ["j0"]]  # side streams start after the caller's work
    rt.switch(2)
    assert current[0].name == "s2"
    rt.wait(1)
    rt.record(0)
    rt.keep("a")
    assert rt._side[1].waited == ["j0", "e1"] and log[-2:] == ["record e0 on s2", "keep on s2"]
    rt.join("out")
    assert current[0].name == "caller" and rt._streams[0].waited == ["j1", "j2"]
    assert log[-3:] == ["record j1 on s1", "record j2 on s2", "keep on caller"]  # the output lives on the caller


def test_abort_gives_the_caller_its_stream_back(fake_cuda):
    rt, _, current = fake_cuda
    rt.fork("x")
    rt.switch(1)
    rt.abort()
    assert current[0].name == "caller" and rt._current == 0


def test_protect_records_the_tensor_on_each_named_stream(fake_cuda):
    rt, log, _ = fake_cuda
    rt.fork("x")
    rt.protect("saved", (1, 2))
    assert log[-2:] == ["keep on s1", "keep on s2"]


def test_plans_share_their_devices_side_streams(monkeypatch):
    """Every plan's side streams are the device's shared ones: streams of their own per plan (a forward's, a
    backward's, each candidate of streams="auto") would each keep cached blocks and a cuBLAS workspace."""
    import contextlib

    made: list = []

    class CountedStream(FakeStream):
        def __init__(self, device=None, priority=0):
            super().__init__(f"s{len(made)}")
            self.priority = priority
            made.append(self)

    monkeypatch.setattr(torch.cuda, "Stream", CountedStream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent("e", []))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(runtime_module, "_SIDE_STREAMS", {})
    monkeypatch.setattr(runtime_module, "_WEIGHT_GRAD_STREAMS", {})
    device = torch.device("cuda", 0)
    forward, backward = StreamRuntime(4, 2, weight_grad_stream=True), StreamRuntime(2, 1, weight_grad_stream=True)
    forward._bind(device)
    backward._bind(device)
    assert backward._side == forward._side[:1] and backward._weight_grad is forward._weight_grad
    assert len(made) == 4  # three side streams and one weight-gradient stream for the device, not six and two
    assert forward._weight_grad.priority == 0

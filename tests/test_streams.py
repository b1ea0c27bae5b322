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


class Towers(torch.nn.Module):
    """Four towers on a stem; each saves two of its own outputs (tanh's) for backward."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(6, 16)
        self.towers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                                              torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(4))
        self.head = torch.nn.Linear(64, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.head(torch.cat([t(h) for t in self.towers], dim=1))


def activate_on_cpu(rt, monkeypatch):
    """Bind ``rt`` to fake streams and events and let it act on CPU tensors as on CUDA ones (``record_stream``
    logged); return the log."""
    log, current = [], [FakeStream("caller")]
    rt._device = "cpu"  # already bound: _bind returns at once
    rt._side = [FakeStream(f"s{i}") for i in range(1, rt.num_streams)]
    rt._events = [FakeEvent(f"e{i}", log) for i in range(rt.num_events)]
    rt._join_events = [FakeEvent(f"j{i}", log) for i in range(rt.num_streams)]
    monkeypatch.setattr(runtime_module, "cuda_device_in", lambda *values: "cpu")
    monkeypatch.setattr(runtime_module, "_on_device", lambda t: True)
    monkeypatch.setattr(runtime_module, "_record", lambda t, stream: log.append(("keep", stream.name)))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: None, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    return log


@pytest.fixture(params=[False, True], ids=["", "split_weight_grads"])
def active_plan(monkeypatch, request):
    """A 4-stream plan of Towers whose runtime is active on CPU tensors (fake streams and events, record_stream
    logged): what it does on CUDA, in issue order; with its weight gradients split off or not (their autograd
    nodes save tensors too)."""
    from concur.fx.plan import build_plan

    monkeypatch.setenv("CONCUR_SAVED_ON_CALLER", "1")
    torch.manual_seed(0)
    model = Towers()
    x = torch.randn(5, 6)
    plan = build_plan(model, (x,), streams=4, scheduler="critical_path", split_weight_grads=request.param)
    assert plan.runtime.saved_on_caller and plan.schedule.num_streams == 4
    assert (plan.weight_grad_splits > 0) == request.param
    log = activate_on_cpu(plan.runtime, monkeypatch)
    plan.runtime._weight_grad = FakeStream("weight grads") if request.param else None
    return model, x, plan, log


def test_saved_activations_a_side_stream_makes_are_moved_to_the_caller_once_it_has_waited_for_them(active_plan):
    """Each side tower's two tanh outputs (the second Linear saves the first too: moved once) are copied to the
    caller's stream before backward; the gradients are the model's, exactly."""
    import copy

    model, x, plan, log = active_plan
    reference = copy.deepcopy(model)
    stream = plan.schedule.stream
    side_towers = {name.split("_")[1] for name, s in stream.items() if s and name.startswith("towers")}
    assert side_towers, "the plan keeps some towers on side streams"
    # and the head's input, where the head runs on the side stream that made it (the cat)
    head = stream["head"] != 0 and stream["cat"] == stream["head"]
    out = plan.generated(x)
    assert plan.runtime.moved == 2 * len(side_towers) + head and plan.runtime._hooks is None
    out.square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert ("keep", "caller") in log  # each original is protected for the caller's copy that reads it


def test_without_the_option_nothing_is_moved(active_plan, monkeypatch):
    model, x, plan, _ = active_plan
    plan.runtime.saved_on_caller = False
    plan.generated(x).sum().backward()
    assert plan.runtime.moved == 0


def test_a_saved_tensor_changed_in_place_before_it_is_moved_stays_and_backward_raises_as_autograd_does():
    rt = StreamRuntime(2, 1, saved_on_caller=True, event_streams=[1])
    rt._streams, rt._current, rt._pending, rt._moved_upto = ["caller", "s1"], 1, [[], []], [0, 0]
    t = torch.ones(3)
    import concur.streams as m
    saved = m._Saved(t)
    rt._pending[1].append(saved)
    t.add_(1)
    rt._move(1, 1)
    assert not saved.moved and rt.moved == 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        StreamRuntime._unpack(saved)


def test_the_runtime_needs_each_events_stream_to_move_saved_tensors():
    with pytest.raises(ValueError, match="the stream of each of the 2 events"):
        StreamRuntime(3, 2, saved_on_caller=True, event_streams=[1])


@pytest.fixture
def active_runtime(monkeypatch):
    """A 2-stream runtime, active on CPU tensors, moving saved tensors; returns (runtime, log)."""
    rt = StreamRuntime(2, 2, saved_on_caller=True, event_streams=[1, 0])
    return rt, activate_on_cpu(rt, monkeypatch)


def test_the_callers_wait_for_a_side_stream_moves_what_that_stream_saved_before_the_event(active_runtime):
    """Not only at the join: after the caller's wait for event 0, its next event moves what the side stream saved
    before recording event 0, so the side stream's blocks serve a later branch; what it saved after waits for a
    later wait or the join."""
    import weakref

    rt, _ = active_runtime
    x = torch.randn(4, requires_grad=True)
    rt.fork(x)
    rt.switch(1)
    a = torch.tanh(x * 2)  # tanh saves its output, made on the side stream
    made = weakref.ref(a)
    rt.record(0)
    b = torch.tanh(a * 3)  # saved after the event
    rt.switch(0)
    rt.wait(0)
    assert rt.moved == 0, "not before the caller's next event: the side streams would wait for the copies"
    rt.record(1)
    assert rt.moved == 1
    del a
    assert made() is None, "the side stream's original is given back once the caller's copy has read it"
    rt.join(b)
    assert rt.moved == 2 and rt._hooks is None
    b.sum().backward()
    torch.testing.assert_close(x.grad, (1 - torch.tanh(3 * torch.tanh(2 * x.detach())) ** 2) * 3 *
                               (1 - torch.tanh(2 * x.detach()) ** 2) * 2)


def test_a_callers_op_that_saves_what_a_side_stream_made_saves_a_copy_at_once(active_runtime):
    rt, log = active_runtime
    x = torch.randn(4, requires_grad=True)
    rt.fork(x)
    rt.switch(1)
    a = x * 2
    rt.record(0)
    rt.switch(0)
    rt.wait(0)
    rt.keep(a)  # the caller reads a tensor of the side stream
    moved = rt.moved
    y = torch.sin(a)  # sin saves its input
    assert rt.moved == moved + 1
    rt.join(y)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(2 * x.detach()) * 2)


def test_a_parameter_or_a_view_of_one_saved_on_a_side_stream_is_not_moved(active_runtime):
    rt, _ = active_runtime
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    rt.fork(x)
    rt.switch(1)
    rt.keep(x)
    out = linear(x)  # saves x (the caller's) and the weight's transpose
    rt.join(out)
    assert rt.moved == 0


@pytest.mark.parametrize("reuses", [True, False])
def test_inside_a_capture_saved_tensors_move_only_where_the_allocator_reuses_the_blocks_they_leave(
        active_runtime, monkeypatch, reuses):
    """Without the allocator's reuse of blocks other streams read (torch < 2.9), a capture holds every block the
    caller's copies read to its end: the copies would add memory, so nothing moves."""
    from concur import _torch_compat as compat

    rt, _ = active_runtime
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(compat, "captures_reuse_cross_stream_blocks", lambda: reuses)
    x = torch.randn(4, requires_grad=True)
    rt.fork(x)
    rt.switch(1)
    a = torch.tanh(x)
    rt.join(a)
    assert rt.moved == (1 if reuses else 0)

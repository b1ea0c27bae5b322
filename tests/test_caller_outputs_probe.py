"""experiments/caller_outputs.py, the probe of side-stream outputs made on the caller's stream, on the CPU with
torch.cuda's streams faked: with ``launch`` set, every op below autograd goes on the launch stream while torch's
current stream stays the caller's, and the results and gradients are the plain ones."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from experiments import caller_outputs


class FakeStream:
    def __init__(self, name: str):
        self.name = name


def test_backward_on_caller_launches_every_op_on_the_side_stream_with_the_same_results(monkeypatch):
    caller, side, launched = FakeStream("caller"), FakeStream("side"), []

    @contextlib.contextmanager
    def on(stream):
        launched.append(stream.name)
        yield
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: caller)
    caller_outputs.COUNTS.clear()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    plain = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8)
    mode = caller_outputs.CallerOutputs(caller)
    with mode:
        mode.launch = side
        out = net(x)
    out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), plain.parameters()))
    assert launched and set(launched) == {"side"}
    assert caller_outputs.COUNTS["launched on a side stream"] == len(launched)
    # CPU tensors: no handler moves an output (they are CUDA-only), each says it kept the op
    assert caller_outputs.COUNTS["kept aten.convolution.default"] == 1


def test_on_the_callers_stream_the_mode_does_nothing(monkeypatch):
    caller = FakeStream("caller")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: caller)
    caller_outputs.COUNTS.clear()
    with caller_outputs.CallerOutputs(caller):
        torch.ones(3) + 1
    assert not caller_outputs.COUNTS


class Recorder(FakeStream):
    def __init__(self, name: str, log: list):
        super().__init__(name)
        self.log = log

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def test_a_side_stream_waits_for_the_callers_only_where_the_caller_was_given_work_since(monkeypatch):
    """An output made on the caller's stream may take a block the caller's queued work frees: the side stream waits
    for the caller's stream first, unless it already waited after the caller's last op."""
    log: list = []
    caller, side = Recorder("caller", log), Recorder("side", log)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(f"kept for {s.name}"))
    mode = caller_outputs.CallerOutputs(caller)
    make = lambda: mode.empty((2,), torch.float32, torch.device("cpu"), torch.contiguous_format, side)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: caller)
    make()  # nothing queued on the caller's stream since the fork
    with mode:
        torch.ones(2).add_(1)  # the caller's stream is given work
    make(), make()
    assert log == ["kept for side", "side waits for caller", "kept for side", "kept for side"]

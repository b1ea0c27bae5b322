"""experiments/caller_outputs.py, the probe over concur's caller memory, on the CPU with torch.cuda's streams
faked: its first form (``outputs``) launches each op on torch's current stream, as the plain plan does, with the
results and gradients of the plain ops; :func:`install` gives each form to the plans' runtime."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from concur import streams
from experiments import caller_outputs


class FakeStream:
    def __init__(self, name: str):
        self.name = name


def test_the_outputs_form_launches_each_op_on_torchs_current_stream_with_the_same_results(monkeypatch):
    caller, side, launched = FakeStream("caller"), FakeStream("side"), []
    current = [side]

    @contextlib.contextmanager
    def on(stream):
        launched.append(stream.name)
        yield
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    plain = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8)
    mode = caller_outputs.CallerOutputs(caller)
    with mode:
        out = net(x)
        current[0] = caller
        out = out + 0  # on the caller's stream: run as it is
    out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), plain.parameters()))
    assert launched and set(launched) == {"side"} and mode.launched == len(launched)


def test_install_gives_the_plans_runtime_each_form_and_a_second_install_starts_from_concurs_own(monkeypatch):
    for name in ("__init__", "fork", "_leave_mode"):  # patched: restored after
        monkeypatch.setattr(streams.StreamRuntime, name, getattr(streams.StreamRuntime, name))
    monkeypatch.delattr(streams.StreamRuntime, "_probe_originals", raising=False)
    fork = streams.StreamRuntime.fork
    caller_outputs.install("backward-on-caller")
    assert streams.StreamRuntime(3, 1).caller_memory and streams.StreamRuntime.fork is fork
    caller_outputs.install("outputs")
    assert not streams.StreamRuntime(3, 1).caller_memory and streams.StreamRuntime.fork is not fork
    rt = streams.StreamRuntime(3, 1)
    rt.fork(torch.ones(1))  # CPU: inactive, no mode
    rt.join()
    assert getattr(rt, "_probe_mode", None) is None and rt._mode is None

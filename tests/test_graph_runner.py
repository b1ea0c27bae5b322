"""The graph runner's pools, with torch.cuda's graph API faked (CPU): what setup times is captured in a pool given
back before the step's capture, so a step holds only what its own graphs need (concur.training.graph_runner)."""

from __future__ import annotations

import contextlib
import itertools

import torch

from concur.training import graph_runner


class _FakeStream:
    cuda_stream = 1

    def __init__(self, priority: int = 0):
        pass

    def wait_stream(self, other) -> None:
        pass


def _fake_cuda(monkeypatch, runner) -> list[tuple[str, object, int]]:
    """Fake the CUDA calls the runner makes; return the log of (what, pool, timing graphs held at the time)."""
    log: list[tuple[str, object, int]] = []
    handles = itertools.count()
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _FakeStream())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", next(handles)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append(("capture", pool, len(runner._held)))  # torch.cuda.graph empties the cache here
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)

    def replays(one, streams, device, warmup=1, *, pool=None, capture_stream=None, keep=None):
        log.append(("timing", pool, len(runner._held)))
        keep[:] = ["a timing graph"]
        return [(1.0, 0.9)]

    monkeypatch.setattr(graph_runner, "alternating_replays", replays)
    return log


def test_setup_times_in_a_pool_of_its_own_given_back_before_the_steps_capture(monkeypatch):
    runner = graph_runner.CudaGraphRunner(priority=False)
    log = _fake_cuda(monkeypatch, runner)
    device = torch.device("cuda")
    runner.time_programs(lambda: None, lambda: None, device)
    runner.time_programs(lambda: None, lambda: None, device)
    runner.capture(lambda: "out", step=None)
    runner.time_programs(lambda: None, lambda: None, device)  # a second input shape's setup
    runner.capture(lambda: "out", step=None)
    (t1, t2, c1, t3, c2) = log
    assert t1[1] == t2[1]  # the timings of one setup share a pool
    assert c1[1] != t1[1] and c2[1] == c1[1]  # the step's graphs share theirs, apart from the timing pool
    assert c1[2] == 0 and c2[2] == 0  # no timing graph holds the timing pool once the step captures
    assert t3[1] not in (t1[1], c1[1])  # the next setup times in a new pool: torch refuses a pool with no graph left

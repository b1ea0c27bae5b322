"""torch.cuda's stream, event and graph API faked on a CPU, for tests of what setup captures, in which pool, and
when the memory is given back (concur.dag.measure, concur.training.graph_runner)."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field

import torch


class FakeStream:
    cuda_stream = 1

    def __init__(self, device=None, priority: int = 0):
        pass

    def wait_stream(self, other) -> None:
        pass


class FakeEvent:
    """Each event records the fake clock: the number of replays so far, each one ``FakeCuda.replay_ms`` long."""

    def __init__(self, cuda: "FakeCuda"):
        self.cuda, self.at = cuda, 0.0

    def record(self) -> None:
        self.at = self.cuda.clock_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.at - self.at


@dataclass
class FakeCuda:
    """The log of what was captured and freed. ``replay_ms(index of the graph in its pool)`` sets each replay's time."""

    replay_ms: object = lambda i: 1.0
    clock_ms: float = 0.0
    log: list = field(default_factory=list)  # ("capture", pool) / ("empty_cache", graphs alive)
    graphs: list = field(default_factory=list)  # weak references to every graph made

    def alive(self) -> int:
        return sum(r() is not None for r in self.graphs)


def fake_cuda(monkeypatch) -> FakeCuda:
    cuda = FakeCuda()
    handles = itertools.count()

    class Graph:
        def __init__(self):
            self.index = 0
            cuda.graphs.append(weakref.ref(self))

        def replay(self) -> None:
            cuda.clock_ms += cuda.replay_ms(self.index)

    captured_in: dict = {}

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        g.index = captured_in.get(pool, 0)
        captured_in[pool] = g.index + 1
        cuda.log.append(("capture", pool))
        yield

    for name, value in {"Stream": FakeStream, "stream": lambda s: contextlib.nullcontext(),
                        "current_stream": lambda *a: FakeStream(), "default_stream": lambda *a: FakeStream(),
                        "device": lambda d: contextlib.nullcontext(), "current_device": lambda: 0,
                        "graph_pool_handle": lambda: ("pool", next(handles)), "CUDAGraph": Graph, "graph": graph,
                        "Event": lambda enable_timing=False: FakeEvent(cuda),
                        "empty_cache": lambda: cuda.log.append(("empty_cache", cuda.alive()))}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    return cuda

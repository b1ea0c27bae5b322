"""experiments/capture_memory_probe.py: each capture of a concur step recorded with the allocator's state as it
begins and ends, on the CPU with the allocator faked: a capture that fits and one that runs out, the setup call of
each, and the default pool's segments with the frames of their live blocks."""

from __future__ import annotations

import contextlib

import pytest
import torch

from concur.training import graph_runner
from experiments import capture_memory_probe as probe
from experiments.memory_records import MB

SEGMENTS = [  # a freed activation's segment held by a workspace, and a graph pool's
    dict(segment_pool_id=(0, 0), stream=7, total_size=86 * MB, allocated_size=32 * MB,
         blocks=[dict(size=32 * MB, state="active_allocated",
                      frames=[dict(filename="/x/concur/training/batch_checks.py", line=148, name="_try"),
                              dict(filename="/usr/lib/python3/threading.py", line=1, name="run")]),
                 dict(size=54 * MB, state="inactive")]),
    dict(segment_pool_id=(0, 3), stream=7, total_size=100 * MB, allocated_size=10 * MB, blocks=[]),
]


@pytest.fixture
def fake_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: {"inactive_split_bytes.all.current": 54 * MB,
                                                                 "segment.all.current": 2})
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 186 * MB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 42 * MB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 300 * MB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: SEGMENTS)

    @contextlib.contextmanager
    def capturing(graph, pool, stream):
        yield

    monkeypatch.setattr(graph_runner, "capturing", capturing)


def test_each_capture_is_recorded_with_its_call_the_memory_as_it_begins_and_how_it_ended(fake_allocator):
    records, calls = [], [0]
    probe.install(records, calls)
    with graph_runner.capturing(None, None, None):
        pass
    calls[0] = 16
    with pytest.raises(torch.OutOfMemoryError):
        with graph_runner.capturing(None, None, None):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 170.00 MiB")
    fitted, failed = records
    assert (fitted["call"], fitted["outcome"], failed["call"], failed["outcome"]) == (0, "captured", 16, "failed")
    assert failed["error"].startswith("CUDA out of memory") and failed["peak_reserved_mb"] == 300.0
    assert fitted["begin"]["reserved_mb"] == 186.0 and fitted["before"]["inactive_split_mb"] == 54.0
    assert fitted["after"]["by_pool_and_stream"] == {"default stream0": [86.0, 32.0], "pool0.3 stream0": [100.0, 10.0]}
    # the default pool's segments only, each live block with the project's frames that made it
    (segment,) = failed["begin"]["segments"]
    assert segment == dict(stream=7, mb=86.0, allocated_mb=32.0,
                           live=[dict(mb=32.0, frames=["batch_checks.py:148 _try"])])

"""On the GPU: a capture that fails leaves nothing behind, and no collection can fail a capture.

Each test runs in a process of its own where it changes process-wide state
(the memory fraction): ``python -m pytest -m cuda tests/test_gpu_capture_failure.py``
runs them in order; the fraction is put back after each.
"""

from __future__ import annotations

import gc

import pytest
import torch

from concur.training import graph_runner
from tests.conftest import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


class Cycle:
    """A captured graph kept alive only by a reference cycle: the cyclic collector frees it when it runs."""

    def __init__(self, graph):
        self.graph, self.me = graph, self


def _captured_graph(runner):
    x = torch.ones(8, device="cuda")
    graph, _ = runner.capture(lambda: x * 2, step=None)
    return graph


def test_a_graph_freed_by_the_collector_cannot_fail_a_capture():
    """What failed a re-capture under load: a CUDA graph in a reference cycle became garbage and the collector,
    running at a moment of its own choosing inside another capture, freed it ("operation not permitted when
    stream is capturing"), which invalidated that capture. The collector is held off during captures."""
    runner = graph_runner.CudaGraphRunner(priority=False)
    holder = [Cycle(_captured_graph(runner))]
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # any allocation of a container may run the collector
    try:
        def body():
            holder.clear()  # the cycle becomes garbage mid-capture
            junk = [[i] for i in range(1000)]  # allocations that would trigger a collection
            return torch.randn(8, device="cuda") + len(junk)

        graph, out = runner.capture(body, step=None)
    finally:
        gc.set_threshold(*threshold)
    graph.replay()
    torch.cuda.synchronize()
    assert out.shape == (8,)
    gc.collect()  # the cycle goes now, outside any capture


def test_a_capture_that_runs_out_of_memory_leaves_no_pool_recording_no_generator_capturing_and_no_memory():
    """Out of memory mid-capture under a process limit: the runner's cleanup gives the pool's memory back, the
    next capture (with random numbers) succeeds in a new pool, and random numbers work eagerly."""
    runner = graph_runner.CudaGraphRunner(priority=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    base = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (base + (512 << 20)) / total))
    try:
        def too_big():
            kept = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]  # 1 GiB
            return kept

        with pytest.raises(RuntimeError):
            runner.capture(too_big, step=None)
        runner.failed()
        assert torch.cuda.memory_reserved() <= base + (64 << 20), "the failed capture's pool must be given back"
        runner.release_old_pool()
        graph, out = runner.capture(lambda: torch.nn.functional.dropout(torch.ones(1024, device="cuda"), 0.5),
                                    step=None)
        graph.replay()
        torch.rand(4, device="cuda")  # the generator is out of capture mode
        torch.cuda.synchronize()
        assert 0 < out.count_nonzero().item() < 1024
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)

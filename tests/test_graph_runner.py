"""The graph runner's pools, with torch.cuda's graph API faked (CPU): what setup times is captured in a pool of its
own, given back when each timing ends, so neither setup nor the step holds it (concur.training.graph_runner,
concur.dag.measure.replay_rounds)."""

from __future__ import annotations

import torch

from concur.training import graph_runner
from tests.fake_cuda_graphs import fake_cuda


def test_each_timing_captures_in_a_pool_of_its_own_given_back_when_it_ends(monkeypatch):
    cuda = fake_cuda(monkeypatch)
    runner = graph_runner.CudaGraphRunner(priority=False)
    device = torch.device("cuda")
    runner.time_programs(lambda: None, lambda: None, device)
    runner.time_programs(lambda: None, lambda: None, device)
    step_graph, _ = runner.capture(lambda: "out", step=None)
    runner.time_programs(lambda: None, lambda: None, device)  # a second input shape's setup
    second_graph, _ = runner.capture(lambda: "out", step=None)
    captures = [pool for what, pool in cuda.log if what == "capture"]
    t1, t1b, t2, t2b, c1, t3, t3b, c2 = captures
    assert t1 == t1b and t2 == t2b and t3 == t3b  # the two programs of one timing share its pool
    assert len({t1, t2, t3, c1}) == 4  # every timing has its own, none is the step's
    assert c2 == c1  # the step's graphs share theirs
    # after each timing its graphs are gone and the cache emptied: only the step's graphs stay alive
    emptied = [alive for (what, alive), (then, _) in zip(cuda.log, cuda.log[1:] + [("end", None)])
               if what == "empty_cache" and then != "capture"]  # those before a capture: the test below
    assert emptied[:2] == [0, 0] and emptied[3] == 1, cuda.log
    assert cuda.alive() == 2 and step_graph is not second_graph


def test_a_pool_left_for_a_new_one_is_given_back_once_before_the_next_capture(monkeypatch):
    """After new_pool() (the first calls' trial has decided), release_old_pool() empties the cache once, with no
    graph of the old pool alive; later captures go to the new pool and release nothing more."""
    cuda = fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runner = graph_runner.CudaGraphRunner(priority=False)
    runner.release_old_pool()
    assert ("empty_cache", 0) not in cuda.log, "nothing to give back before any new_pool()"
    graph, _ = runner.capture(lambda: "out", step=None)
    runner.new_pool()
    del graph
    before = len(cuda.log)
    runner.release_old_pool()
    runner.release_old_pool()
    assert cuda.log[before:] == [("empty_cache", 0)]
    runner.capture(lambda: "out", step=None)
    first, second = [pool for what, pool in cuda.log if what == "capture"]
    assert first != second


def test_every_capture_begins_with_the_cache_given_back(monkeypatch):
    """What the warm-up cached outside the pool counts against the process's memory, and a capture that runs out
    cannot free it (the allocator's cudaFree would invalidate the capture): each capture empties the cache first,
    the timings' two programs and the step's alike."""
    cuda = fake_cuda(monkeypatch)
    runner = graph_runner.CudaGraphRunner(priority=False)
    runner.time_programs(lambda: None, lambda: None, torch.device("cuda"))
    runner.capture(lambda: "out", step=None)
    before = [cuda.log[i - 1] if i else None for i, (what, _) in enumerate(cuda.log) if what == "capture"]
    assert len(before) == 3 and all(b is not None and b[0] == "empty_cache" for b in before), cuda.log


def test_a_pool_left_is_given_back_though_its_graph_sits_in_an_old_reference_cycle(monkeypatch):
    """A trial's graph lives through many calls, so a reference cycle holding it reaches the oldest generation,
    which the young collection before each capture does not walk: giving the old pool back collects in full
    first, or the cache is emptied while the graph is still alive and the pool stays reserved."""
    import gc

    cuda = fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runner = graph_runner.CudaGraphRunner(priority=False)
    graph, _ = runner.capture(lambda: "out", step=None)
    cycle: list = [graph]
    cycle.append(cycle)
    del graph
    gc.collect()  # the cycle, still referred to, is now in the oldest generation
    del cycle
    runner.new_pool()
    before = len(cuda.log)
    runner.release_old_pool()
    assert cuda.log[before:] == [("empty_cache", 0)], "the old pool's graph was alive when the cache was emptied"

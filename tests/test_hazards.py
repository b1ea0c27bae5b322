"""Hazard edges: in-place ops, views, buffers and RNG order the DAG; without them results go wrong."""

from __future__ import annotations

import torch

import concur
import concur.dag.hazards
from concur.dag.annotate import RNG
from concur.fx.plan import analyse
from tests.models import BufferMutation, DropoutBranches, InplaceHazard, SharedBatchNorm, ViewAlias


def _edges(model, inputs):
    _, dag = analyse(model, inputs)
    by_target = {}
    for n, d in dag.nodes(data=True):
        by_target.setdefault(d["target"], []).append(n)
    return dag, by_target


def test_inplace_write_waits_for_earlier_reader_and_precedes_later_reader():
    dag, t = _edges(InplaceHazard(), (torch.randn(1, 3, 8, 8),))
    cheap = t["mul"][0]               # a * 2.0
    first_write = t[".mul_"][0]
    assert dag.edges[cheap, first_write]["kind"] == "hazard"      # write after read
    relu = t["relu"][0]
    assert nx_path(dag, first_write, relu)


def nx_path(dag, a, b):
    import networkx as nx
    return nx.has_path(dag, a, b)


def test_write_through_view_is_ordered_after_reader_of_base():
    dag, t = _edges(ViewAlias(), (torch.randn(1, 3, 8, 8),))
    reader = t[".sum"][0]
    zero = t[".zero_"][0]
    assert dag.has_edge(reader, zero)


def test_buffer_updates_are_ordered_and_kept():
    dag, t = _edges(BufferMutation(), (torch.randn(1, 3, 8, 8),))
    assert ".add_" in t and ".mul_" in t
    mul_ = t[".mul_"][0]
    add_update = [n for n in t[".add_"] if nx_path(dag, mul_, n)]
    assert add_update, "ema.mul_(...).add_(...) must follow mul_"
    reader_after = [n for n in t["add"] if nx_path(dag, add_update[0], n)]
    assert reader_after, "the read of ema after its update must depend on the update"


def test_shared_module_state_updates_are_ordered():
    dag, t = _edges(SharedBatchNorm().train(), (torch.randn(2, 3, 8, 8),))
    first, second = t["bn"]
    assert nx_path(dag, first, second)


def test_random_draws_keep_program_order():
    dag, t = _edges(DropoutBranches().train(), (torch.randn(2, 16),))
    draws = [n for n in dag if RNG in dag.nodes[n]["facts"].writes]
    assert len(draws) >= 5
    for a, b in zip(draws, draws[1:]):
        assert nx_path(dag, a, b), f"{a} and {b} draw random numbers out of order"


def test_without_hazard_edges_the_plan_gives_wrong_results(monkeypatch):
    """The equality tests can fail: drop the hazard edges and the schedule reorders a write."""
    model = InplaceHazard()
    x = torch.randn(2, 3, 8, 8)
    expected = model(x.clone())
    monkeypatch.setattr(concur.dag.hazards, "hazard_edges", lambda accesses: set())
    broken = concur.optimize(model, (x,), streams=2)
    actual = broken(x.clone())
    assert not torch.allclose(actual, expected, rtol=1e-3)

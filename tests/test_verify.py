"""The static checker of generated code catches a dropped wait."""

from __future__ import annotations

import torch

import concur
from concur.verify import verify_generated
from tests.models import WideNet


def test_generated_plan_verifies_and_a_dropped_wait_is_caught():
    cm = concur.optimize(WideNet(branches=6), (torch.randn(1, 3, 8, 8),), streams=4)
    plan = cm.plan
    graph = plan.generated.graph
    assert verify_generated(graph, plan.dag, plan.schedule.num_streams) == []
    waits = [n for n in graph.nodes if n.op == "call_method" and n.target == "wait"]
    assert waits
    graph.erase_node(waits[-1])
    problems = verify_generated(graph, plan.dag, plan.schedule.num_streams)
    assert any("may start before" in p for p in problems)

"""The static checker of generated code catches a dropped wait, with the schedulers' own replay."""

from __future__ import annotations

import torch

import concur
import schedulers
from concur.fx.verify import issue_steps, verify_generated
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
    assert any("is not ordered" in p for p in problems)


def test_generated_code_and_schedule_are_checked_by_one_replay():
    """The fx code's issue program, replayed, agrees with the schedule's own (schedulers.schedule_steps)."""
    cm = concur.optimize(WideNet(branches=6), (torch.randn(1, 3, 8, 8),), streams=4)
    plan = cm.plan
    steps = issue_steps(plan.generated.graph)
    issued = [v for op, v in steps if op == "issue"]
    assert [v for v in issued if v in plan.schedule.stream] == [v for v in plan.schedule.order if v in issued]
    assert schedulers.replay(plan.dag, steps, [v for v in plan.dag if v not in issued]).problems == ()
    record = next(i for i, (op, _) in enumerate(steps) if op == "record")
    waited = steps[record][1]
    early = [s for s in steps if s != steps[record]]
    early.insert(0, ("wait", waited))  # the wait now comes before its event is recorded
    assert any("before it is recorded" in p for p in schedulers.replay(plan.dag, early).problems)

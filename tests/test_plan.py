"""concur.plan: trace, cost, schedule and generate, checked; free ops hoisted; broken plans and bad inputs refused."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from concur.errors import ExampleInputError, PlanError
from concur.fx import plan as plan_module
from concur.fx.plan import analyse, build_plan, device_name, hoistable
from tests.test_codegen import Diamond


class BufferView(nn.Module):
    """A transposed buffer is a view of model state: no kernel, no input, so it runs before the fork."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(4, 4))

    def forward(self, x):
        return torch.relu(x @ self.w.t()) + torch.sigmoid(x)


def test_a_plan_puts_the_diamonds_branches_on_two_streams_and_computes_the_same():
    torch.manual_seed(0)
    model, x = Diamond(), torch.randn(2, 3, 8, 8)
    p = build_plan(model, (x,), streams=4, scheduler="critical_path")
    assert p.schedule.num_streams == 2 and p.schedule.stream["left"] != p.schedule.stream["right"]
    assert set(p.schedule.order) == set(p.dag) and p.runtime.num_streams == 2
    assert "switch" in p.code and "wait" in p.code and p.runtime_attr in p.code
    torch.testing.assert_close(p.forward(p.traced, x), model(x), rtol=0, atol=0)


def test_ops_without_kernels_or_inputs_are_hoisted_before_the_fork():
    model, x = BufferView(), torch.randn(3, 4)
    _, dag = analyse(model, (x,))
    assert hoistable(dag) == {"t"}
    p = build_plan(model, (x,), streams=2, scheduler="critical_path")
    assert "t" not in p.schedule.order
    code = p.code
    assert code.index(".t()") < code.index(".fork(")
    torch.testing.assert_close(p.forward(p.traced, x), model(x), rtol=0, atol=0)


def test_a_plan_whose_code_drops_a_wait_is_refused_as_a_concur_bug(monkeypatch):
    real_generate = plan_module.generate

    def without_waits(*args, **kwargs) -> fx.Graph:
        graph = real_generate(*args, **kwargs)
        for n in [n for n in graph.nodes if n.op == "call_method" and n.target == "wait"]:
            graph.erase_node(n)
        return graph

    monkeypatch.setattr(plan_module, "generate", without_waits)
    with pytest.raises(PlanError, match="please report this bug"):
        build_plan(Diamond(), (torch.randn(2, 3, 8, 8),), streams=2, scheduler="critical_path")


def test_inputs_the_model_rejects_are_named_with_the_fix():
    with pytest.raises(ExampleInputError, match="Fix: pass example inputs") as info:
        build_plan(nn.Sequential(nn.Linear(4, 2), nn.ReLU()), (torch.randn(3, 5),), 2, "critical_path")
    assert isinstance(info.value.original, RuntimeError) and "mat1 and mat2" in str(info.value.original)


def test_the_device_name_comes_from_the_inputs_or_parameters():
    assert device_name(Diamond(), (torch.randn(1, 3, 4, 4),)) == "cpu"

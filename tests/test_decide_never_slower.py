"""Never slower than one stream by prediction (concur.dag.decide): ops that do no arithmetic cost no stream
switch, and a plan predicted slower than one stream is not used.

The models copy what timm does: ``BNAct`` calls batch norm functionally, so BatchNorm's
``num_batches_tracked.add_(1)`` is an op of the traced graph (a 0-d int64 kernel with no
producer and no consumer), and residual blocks add an ``nn.Identity`` shortcut. Costs are the
H100 roofline's, so the predictions do not depend on the machine running the tests.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import concur
import schedulers
from concur.dag.cost import ROOFLINES, AnalyticCost
from concur.fx.plan import analyse, hoistable

H100 = AnalyticCost(ROOFLINES["h100"])


class BNAct(nn.Module):
    """timm's BatchNormAct2d: batch norm called functionally, its step counter an op of its own."""

    def __init__(self, c: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        bn = self.bn
        if self.training:
            bn.num_batches_tracked.add_(1)
        return F.relu(F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                   self.training, bn.momentum, bn.eps))


class Residual(nn.Module):
    """A ResNet basic block: two conv-BN-ReLU in a chain, an identity shortcut."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.act1 = nn.Conv2d(c, c, 3, padding=1, bias=False), BNAct(c)
        self.conv2, self.act2 = nn.Conv2d(c, c, 3, padding=1, bias=False), BNAct(c)
        self.shortcut = nn.Identity()

    def forward(self, x):
        return self.act2(self.conv2(self.act1(self.conv1(x)))) + self.shortcut(x)


class TwoBranch(nn.Module):
    """Two conv branches worth streams of their own, beside an identity shortcut."""

    def __init__(self, c: int):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), BNAct(c))
        self.b = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), BNAct(c))
        self.shortcut = nn.Identity()

    def forward(self, x):
        return self.a(x) + self.b(x) + self.shortcut(x)


def resnet_like(blocks: type[nn.Module], c: int = 8, n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *[blocks(c) for _ in range(n)])


X = torch.randn(2, 3, 16, 16)


def scheduled_dag(model: nn.Module):
    """The costed DAG ``optimize`` schedules (its hoisted prologue left out)."""
    _, dag = analyse(model, (X,), H100)
    return dag.subgraph(n for n in dag if n not in hoistable(dag)).copy()


def trivial_ops(dag) -> set[str]:
    return {v for v, t in dag.nodes(data="trivial") if t}


def test_identities_and_step_counters_are_trivial_and_convolutions_are_not():
    dag = scheduled_dag(resnet_like(Residual))
    names = {dag.nodes[v]["target"]: dag.nodes[v]["trivial"] for v in dag}
    assert names[".add_"] and names["1.shortcut"]  # the counter update and the identity
    assert not names["1.conv1"] and not names["add"]  # real work: a convolution, the residual sum


@pytest.mark.parametrize("scheduler", ["critical_path", "fork"])
def test_trivial_ops_cost_no_wait_of_their_own(scheduler):
    """An Identity shortcut on a side stream would wait for its input and be waited for by the sum: two waits for no work."""
    dag = scheduled_dag(resnet_like(TwoBranch))
    plan = schedulers.schedule(dag, 4, scheduler)
    assert plan.num_streams > 1  # the two conv branches still run side by side
    trivial = trivial_ops(dag)
    assert not [w for w in plan.waits if w.consumer in trivial]
    for v in trivial:
        preds = sorted(dag.predecessors(v), key=plan.order.index)
        if preds:  # with its latest producer; the counters (no neighbour) wherever the op before them runs
            assert plan.stream[v] == plan.stream[preds[-1]]
    # the waits are those of the conv branches alone: a fork into and a join out of each block
    assert len(plan.waits) == 2 * 4
    assert not schedulers.validate(dag, plan)


def test_step_counters_are_not_predicted_as_parallel_work():
    """A chain of residual blocks has no parallel work: counters on side streams would predict a gain (1.19x) that is not there."""
    prediction = concur.inspect(resnet_like(Residual), (X,), cost_model=H100, max_streams=4)
    assert all(abs(s - 1.0) < 1e-9 for s in prediction.predicted_speedup.values())
    assert all(abs(s - 1.0) < 1e-9 for s in prediction.ideal_speedup.values())


def test_optimize_keeps_one_stream_when_streams_would_be_slower(caplog):
    """A chain of blocks whose only side work is trivial: no plan beats one stream, so one is used."""
    model = resnet_like(Residual)
    with caplog.at_level(logging.INFO, logger="concur"):
        fast = concur.optimize(model, (X,), streams=4, cost_model=H100)
    assert fast.schedule.num_streams == 1 and not fast.schedule.waits
    torch.testing.assert_close(fast(X), model(X))


def test_a_plan_predicted_slower_than_one_stream_is_replaced_with_one_info_line(caplog, monkeypatch):
    """The gate itself: whatever the scheduler proposes, a prediction below 1.0 means one stream."""
    model = resnet_like(TwoBranch)
    monkeypatch.setattr(schedulers, "simulate_shared", lambda dag, s: 2 * sum(dag.nodes[v]["cost"] for v in s.order))
    with caplog.at_level(logging.INFO, logger="concur"):
        slow = concur.optimize(model, (X,), streams=4, cost_model=H100)
    assert slow.schedule.num_streams == 1
    lines = [r for r in caplog.records if r.name == "concur"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "one stream" in lines[0].getMessage() and "0.50x" in lines[0].getMessage()


def test_a_plan_predicted_faster_keeps_its_streams(caplog):
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), TwoBranch(64))
    with caplog.at_level(logging.INFO, logger="concur"):
        fast = concur.optimize(model, (torch.randn(8, 3, 32, 32),), streams=4, cost_model=H100)
    assert fast.schedule.num_streams > 1
    lines = [r.getMessage() for r in caplog.records if r.name == "concur"]
    assert len(lines) == 1 and "runs on 2 streams" in lines[0] and "not timed" in lines[0], lines


@pytest.mark.parametrize("name", ["convnext_atto", "poolformer_s12"])
def test_timm_convnext_and_poolformer_are_not_planned_slower(name):
    timm = pytest.importorskip("timm", reason="needs timm, which the test extra installs: pip install -e \".[test]\"")
    model = timm.create_model(name, pretrained=False, num_classes=10)
    x = torch.randn(1, 3, 64, 64)
    plan = concur.optimize(model, (x,), streams=4, cost_model=H100).plan
    serial_us = sum(plan.dag.nodes[v]["cost"] for v in plan.schedule.order)
    assert plan.schedule.num_streams == 1 or serial_us / schedulers.simulate_shared(plan.dag, plan.schedule) >= 1.0


def test_auto_streams_that_settle_on_one_run_one_stream(caplog):
    model = resnet_like(Residual)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (X, torch.randn(2, 8, 16, 16))
    with caplog.at_level(logging.INFO, logger="concur"):
        step = concur.train_step(model, F.mse_loss, optimizer, batch, streams="auto")
    assert step.module.plan.schedule.num_streams == 1


def test_auto_streams_on_a_branchy_net_log_their_one_decision(caplog):
    from tests.models import WideNet

    model = WideNet(branches=4, channels=4)  # small kernels: predicted 1.75x on 3 streams by the CPU roofline
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (torch.randn(2, 3, 8, 8), torch.randn(2, 10))
    with caplog.at_level(logging.INFO, logger="concur"):
        step = concur.train_step(model, F.mse_loss, optimizer, batch, streams="auto")
    assert step.module.plan.schedule.num_streams > 1
    lines = [r.getMessage() for r in caplog.records if r.name == "concur" and "runs on" in r.getMessage()]
    assert len(lines) == 1 and "not timed (no GPU" in lines[0], lines

"""Max pooling that saves no indices (concur.fx.pool_indices): the same results bit for bit, fewer bytes saved,
and the unfused step's fallback after running out of memory planned with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import concur
from concur.fx import plan_timing, pool_indices
from concur.training import rungs
from tests.conftest import autograd_nodes
from tests.test_capture import OOM, FailingGraphs, run
from tests.test_step_habits import make_batches

POOLINGS = [  # kernel, stride, padding, dilation, ceil_mode: GoogLeNet's branch pool, its stem's, others
    (3, 1, 1, 1, True), (3, 2, 0, 1, True), (2, None, 0, 1, False), ((3, 2), (2, 1), (1, 0), 2, False)]


def _saved(run) -> list[torch.Tensor]:
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        run()
    return packed


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("dtype, channels_last, batched", [
    (torch.float64, False, True), (torch.float32, True, True), (torch.bfloat16, True, True),
    (torch.float32, False, False)])
def test_the_same_output_and_gradient_as_the_plain_layer_bit_for_bit(pooling, dtype, channels_last, batched):
    kernel, stride, padding, dilation, ceil_mode = pooling
    g = torch.Generator().manual_seed(0)
    shape = (2, 3, 9, 8) if batched else (3, 9, 8)
    x = torch.randn(shape, generator=g).round(decimals=1).to(dtype)  # rounded: ties, where the first max wins
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    grad = torch.randn(F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode).shape, generator=g).to(dtype)
    outs, grads = [], []
    for pool in (F.max_pool2d, pool_indices.max_pool2d):
        leaf = x.detach().clone().requires_grad_()
        out = pool(leaf, kernel, stride, padding, dilation, ceil_mode)
        out.backward(grad)
        outs.append(out)
        grads.append(leaf.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert outs[0].stride() == outs[1].stride() and grads[0].stride() == grads[1].stride()


def test_it_saves_the_input_alone_where_the_plain_layer_saves_int64_indices_too():
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    plain = _saved(lambda: F.max_pool2d(x, 3, 1, 1))
    lean = _saved(lambda: pool_indices._RecomputedIndices.apply(x, (3, 3), (1, 1), (1, 1), (1, 1), False))
    assert [t.dtype for t in plain] == [torch.float32, torch.int64] and plain[1].shape == (2, 4, 8, 8)
    assert len(lean) == 1 and lean[0] is x, "the input only, which the plain layer saves as well"


def test_where_in_doubt_it_is_the_plain_layer():
    """Saved-tensor hooks (offloading, checkpointing) see what the plain layer saves; no grad, nothing saved."""
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    assert len(_saved(lambda: pool_indices.max_pool2d(x, 3, 1, 1))) == 2
    with torch.no_grad():
        assert torch.equal(pool_indices.max_pool2d(x, 3, 1, 1), F.max_pool2d(x, 3, 1, 1))
    hooked = nn.MaxPool2d(3, 1, 1)
    calls = []
    hooked.register_forward_hook(lambda m, i, o: calls.append(m))
    pool_indices.pool_forward(hooked, x)
    assert calls == [hooked], "a module given hooks after planning is called as it is"


class Pools(nn.Module):
    """Four branches on a shared stem (an Inception block), one through a max-pooling layer as GoogLeNet's, one
    through F.max_pool2d."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 2 * 16)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True)
        self.a = nn.Conv2d(2, 2, 1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)
        self.c = nn.Conv2d(2, 2, 1)
        self.d = nn.Conv2d(2, 2, 3, padding=1)
        self.head = nn.Linear(3 * 2 * 4 * 4 + 2 * 2 * 2, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x)).view(-1, 2, 4, 4)
        a = self.a(self.pool(h))
        b = F.max_pool2d(self.b(h), 2, stride=2, ceil_mode=False)
        return self.head(torch.cat([a.flatten(1), b.flatten(1), self.c(h).flatten(1), self.d(h).flatten(1)], 1))


def _make_pools(seed=0):
    torch.manual_seed(seed)
    return Pools().double()


def _pool_backward_nodes(out: torch.Tensor) -> int:
    return autograd_nodes(out, lambda name: name.startswith("MaxPool2DWithIndicesBackward"))


@pytest.mark.parametrize("lean", [False, True])
def test_a_plan_with_lean_pools_computes_the_models_step_and_saves_no_indices(lean):
    model = _make_pools()
    x = make_batches(1)[0][0]
    module = concur.optimize(model, (x,), streams=2, measure=False, lean_pools=lean)
    assert module.plan.schedule.num_streams == 2 and module.plan.pool_recomputes == (2 if lean else 0)
    out, ref = module(x), model(x)
    assert _pool_backward_nodes(out) == (0 if lean else 2) and _pool_backward_nodes(ref) == 2
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    expected = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_a_lean_plans_measured_decision_is_its_own():
    """The plain plan's cache key is as it always was; the lean plan, other kernels in backward, has another."""
    model = _make_pools()
    x = make_batches(1)[0][0]
    plans = [concur.optimize(model, (x,), streams=2, measure=False, lean_pools=lean).plan for lean in (False, True)]
    keys = [plan_timing.decision_key(model, p.traced, (x,), [p], torch.device("cpu")) for p in plans]
    assert keys[0] != keys[1]
    unmarked = dataclasses.replace(plans[1], pool_recomputes=0)
    assert plan_timing.decision_key(model, unmarked.traced, (x,), [unmarked], torch.device("cpu")) == keys[0]


def test_a_one_stream_plan_stays_the_models_own_program():
    model = _make_pools()
    module = concur.optimize(model, (make_batches(1)[0][0],), streams=1, measure=False, lean_pools=True)
    assert module.plan.pool_recomputes == 0


def test_the_unfused_fallback_after_running_out_of_memory_saves_no_pooling_indices(monkeypatch):
    """4 streams do not fit: the 2-stream plan the step falls back to recomputes its pools' indices in backward
    (their bytes are alive at the step's peak, where the side streams' blocks are held apart); the same run as
    the plain loop, and the warning says so. Where 4 streams fit, the plan is the plain one."""
    oom = FailingGraphs([torch.OutOfMemoryError(OOM)])
    step, said = run(monkeypatch, oom, make_batches(4), streams=4, make=_make_pools)
    assert step.failed_streams == {4} and step.lean_pools and step.status.streams == 2
    assert step.modules[2].plan.pool_recomputes == 2
    (warning,) = said
    assert "running it on 2 streams, its 2 max-pooling layers saving no indices instead" in warning
    assert str(step.status).startswith("captured, 2 streams of 4 asked for: the step on 4 streams does not fit")
    assert "; on 2 streams, its 2 max-pooling layers saving no indices" in step.status.why

    step, said = run(monkeypatch, FailingGraphs([]), make_batches(4), streams=4, make=_make_pools)
    assert not step.lean_pools and step.modules[4].plan.pool_recomputes == 0 and not said
    step.recapture()
    assert not step.lean_pools


def test_lean_pools_first_plans_the_first_program_so(monkeypatch):
    """What experiments/memory.py --lean-pools weighs: every multi-stream plan of the step saving no indices."""
    monkeypatch.setattr(rungs, "LEAN_POOLS_FIRST", True)
    step, said = run(monkeypatch, FailingGraphs([]), make_batches(4), streams=4, make=_make_pools)
    assert step.lean_pools and step.modules[4].plan.pool_recomputes == 2 and not said


def test_googlenets_lean_plan_computes_its_plain_plans_step_bit_for_bit():
    """torchvision's GoogLeNet: its 13 max-pooling layers (4 in the stem with ceil_mode, 9 branch pools)."""
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).double()
    model.dropout.p = 0.0  # the two plans' steps compare without a dropout mask between them
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, requires_grad=True)
    results = []
    for lean in (False, True):
        module = concur.optimize(model, (x,), streams=4, measure=False, lean_pools=lean)
        assert module.plan.pool_recomputes == (13 if lean else 0)
        out = module(x)
        results.append((out, torch.autograd.grad(out.square().sum(), [x, *model.parameters()])))
    (out, grads), (lean_out, lean_grads) = results
    assert torch.equal(out, lean_out) and all(torch.equal(a, b) for a, b in zip(grads, lean_grads))

"""concur.fx.weight_grads: weight gradients recorded apart (CPU: no side stream, same autograd graph as on CUDA).

Every test checks that the split is in place (a count, or ``_WeightGradBackward`` in the autograd graph),
so none passes with the plain module calls; then that autograd's behaviour is the original model's.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import concur
from concur.fx import weight_grads
from concur.streams import StreamRuntime
from tests.conftest import assert_close_rel, autograd_nodes
from tests.models import WideNet
from tests.test_step import plain_loop


class ConvBranches(nn.Module):
    """Convolutions in parallel branches: in-place ReLU right after one, a grouped "same" one, a bias-free one."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.left = nn.Conv2d(4, 4, 3, padding="same", dilation=2, groups=2)
        self.right = nn.Conv2d(4, 4, 1, bias=False)
        self.mid = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        s = F.relu(self.stem(x), inplace=True)
        branches = [torch.tanh(self.left(s)), torch.tanh(self.right(s)), torch.tanh(self.mid(s))]
        return self.head(torch.cat([b.mean(dim=(2, 3)) for b in branches], dim=1))


class LinearBranches(nn.Module):
    """Linear layers on (batch, tokens, features) inputs in two branches; one without bias."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.b = nn.Linear(8, 8, bias=False)
        self.c = nn.Linear(8, 8)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = F.relu(self.inp(x), inplace=True)
        return self.out(torch.cat([self.a(h) * self.c(h), torch.tanh(self.b(h))], dim=-1))


def weighted_sum(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view_as(out)).sum()


def split_nodes(module: nn.Module) -> int:
    return sum(1 for n in module.plan.generated.graph.nodes if n.target is weight_grads.split_forward)


def weight_grad_nodes(out: torch.Tensor) -> int:
    """Count the weight-gradient nodes in the autograd graph behind ``out``."""
    return autograd_nodes(out, "_WeightGradBackward".__eq__)


def optimized_pair(make, x, **kw):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    kw.setdefault("split_weight_grads", True)
    kw.setdefault("streams", 4)
    return concur.optimize(model, (x,), **kw), model, reference


def test_branchy_conv_net_outputs_and_gradients_equal_the_original_in_float64():
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    optimized, model, reference = optimized_pair(lambda: WideNet(branches=6).double(), x)
    assert optimized.plan.weight_grad_splits == 14  # 13 convolutions and the head
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [optimized(inputs[0]), reference(inputs[1])]
    assert weight_grad_nodes(outs[0]) == 14
    assert_close_rel(outs[0], outs[1], 1e-12, "output")
    for out in outs:
        weighted_sum(out).backward()
    assert_close_rel(inputs[0].grad, inputs[1].grad, 1e-12, "input grad")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-12, name)


@pytest.mark.parametrize("make, shape, splits", [(LinearBranches, (3, 5, 6), 6), (ConvBranches, (2, 3, 9, 9), 5)],
                         ids=["linear_3d", "conv_inplace_relu"])
def test_linear_and_conv_models_gradients_equal_the_original_in_float64(make, shape, splits):
    x = torch.randn(*shape, dtype=torch.float64)
    optimized, model, reference = optimized_pair(lambda: make().double(), x)
    assert optimized.plan.weight_grad_splits == splits
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [optimized(inputs[0]), reference(inputs[1])]
    assert weight_grad_nodes(outs[0]) == splits
    for out in outs:
        weighted_sum(out).backward()
    assert_close_rel(outs[0], outs[1], 1e-12, "output")
    assert_close_rel(inputs[0].grad, inputs[1].grad, 1e-12, "input grad")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-12, name)


def test_generated_graph_holds_one_split_node_per_layer_and_none_when_off_or_serial():
    x = torch.randn(2, 3, 8, 8)
    on = concur.optimize(WideNet(branches=6), (x,), streams=4, split_weight_grads=True)
    off = concur.optimize(WideNet(branches=6), (x,), streams=4)  # the default: eager calls pay no host time
    serial = concur.optimize(WideNet(branches=6), (x,), streams=1)
    assert split_nodes(on) == on.plan.weight_grad_splits == 14 and on.plan.runtime.has_weight_grad_stream
    assert split_nodes(off) == off.plan.weight_grad_splits == 0 and not off.plan.runtime.has_weight_grad_stream
    assert off.schedule.num_streams > 1
    assert split_nodes(serial) == serial.plan.weight_grad_splits == 0
    assert on.schedule == off.schedule  # the split follows scheduling and changes nothing of it
    copied = copy.deepcopy(on)
    copied(x)
    assert copied.plan.weight_grad_splits == 14


def test_a_serial_plan_splits_its_weight_gradients_only_where_asked(monkeypatch):
    """concur.fx.plan.SERIAL_WEIGHT_GRADS: the one-stream plan keeps the model's own forward and records its
    weight gradients apart (their stream on CUDA); the gradients are the original's."""
    from concur.fx import plan as plan_module

    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    assert concur.optimize(WideNet(branches=6).double(), (x,), streams=1,
                           split_weight_grads=True).plan.weight_grad_splits == 0
    monkeypatch.setattr(plan_module, "SERIAL_WEIGHT_GRADS", True)
    optimized, model, reference = optimized_pair(lambda: WideNet(branches=6).double(), x, streams=1)
    assert optimized.schedule.num_streams == 1 and optimized.plan.runtime.has_weight_grad_stream
    assert optimized.plan.weight_grad_splits == split_nodes(optimized) == 14
    outs = [optimized(x), reference(x)]
    for out in outs:
        weighted_sum(out).backward()
    assert_close_rel(outs[0], outs[1], 1e-12, "output")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-12, name)


def test_a_layer_reading_an_input_that_needs_no_gradient_keeps_its_call():
    """The stem reads the batch: its backward is its weight gradient alone, last, with no input gradient on the
    caller's stream to overlap; split off, the weight-gradient stream would allocate its workspace. It keeps the
    module's own call (its gradient computed where autograd computes it); every other layer splits."""
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    optimized, model, reference = optimized_pair(lambda: ConvBranches().double(), x)
    assert optimized.plan.weight_grad_splits == 5  # the plan cannot know: the input is checked at each call
    out = optimized(x)
    assert weight_grad_nodes(out) == 4  # left, right, mid, head
    weighted_sum(out).backward()
    weighted_sum(reference(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-12, name)
    assert weight_grad_nodes(optimized(x.clone().requires_grad_())) == 5


def test_tensor_and_post_accumulate_grad_hooks_on_a_weight_fire_with_its_gradient():
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64).requires_grad_()
    optimized, model, reference = optimized_pair(lambda: ConvBranches().double(), x)
    seen = {}
    for tag, m in (("split", model), ("ref", reference)):
        m.left.weight.register_hook(lambda g, tag=tag: seen.__setitem__((tag, "hook"), g.clone()))
        m.left.bias.register_post_accumulate_grad_hook(
            lambda p, tag=tag: seen.__setitem__((tag, "post"), p.grad.clone()))
    out = optimized(x)
    assert weight_grad_nodes(out) == 5
    weighted_sum(out).backward()
    weighted_sum(reference(x)).backward()
    assert set(seen) == {("split", "hook"), ("split", "post"), ("ref", "hook"), ("ref", "post")}
    assert_close_rel(seen["split", "hook"], seen["ref", "hook"], 1e-12, "tensor hook")
    assert_close_rel(seen["split", "post"], seen["ref", "post"], 1e-12, "post-accumulate hook")
    assert_close_rel(seen["split", "hook"], model.left.weight.grad, 0, "hook sees the accumulated gradient")


def test_autograd_grad_wrt_weights_and_wrt_the_input_alone(monkeypatch):
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64).requires_grad_()
    optimized, model, reference = optimized_pair(lambda: ConvBranches().double(), x)
    out = optimized(x)
    assert weight_grad_nodes(out) == 5
    got = torch.autograd.grad(weighted_sum(out), [model.mid.weight, model.head.bias])
    expected = torch.autograd.grad(weighted_sum(reference(x)), [reference.mid.weight, reference.head.bias])
    for g, e in zip(got, expected):
        assert_close_rel(g, e, 1e-12, "autograd.grad")
    assert all(p.grad is None for p in model.parameters())

    calls = []
    real = weight_grads._WeightGrad.backward
    monkeypatch.setattr(weight_grads._WeightGrad, "backward",
                        staticmethod(lambda ctx, g: calls.append(1) or real(ctx, g)))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    (gx,) = torch.autograd.grad(weighted_sum(optimized(xs[0])), xs[0])
    (ex,) = torch.autograd.grad(weighted_sum(reference(xs[1])), xs[1])
    assert_close_rel(gx, ex, 1e-12, "input gradient")
    assert calls == [], "a gradient w.r.t. the input alone must not run weight-gradient nodes"


def test_gradients_accumulate_over_two_backward_calls():
    xs = [torch.randn(3, 5, 6, dtype=torch.float64).requires_grad_() for _ in range(2)]
    optimized, model, reference = optimized_pair(lambda: LinearBranches().double(), xs[0])
    for x in xs:
        out = optimized(x)
        assert weight_grad_nodes(out) == 6
        weighted_sum(out).backward()
        weighted_sum(reference(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-12, name)


def test_double_backward_through_the_weight_gradients_equals_the_original():
    """A gradient penalty: the second backward runs through each layer's weight gradient."""
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64).requires_grad_()
    optimized, model, reference = optimized_pair(lambda: ConvBranches().double(), x)
    for m, mod in ((model, optimized), (reference, reference)):
        out = mod(x)
        params = list(m.parameters())
        grads = torch.autograd.grad(weighted_sum(out), params, create_graph=True)
        sum(g.square().sum() for g in grads).backward()
    assert weight_grad_nodes(optimized(x)) == 5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name  # head.bias: its gradient is a constant
        if q.grad is not None:
            assert_close_rel(p.grad, q.grad, 1e-10, name)


def test_cpu_autocast_bf16_gradients_match_and_have_the_parameters_dtype():
    x = torch.randn(4, 3, 8, 8).requires_grad_()
    optimized, model, reference = optimized_pair(lambda: WideNet(branches=6), x)
    unsplit_model = copy.deepcopy(reference)
    unsplit = concur.optimize(unsplit_model, (x,), streams=4, split_weight_grads=False)
    for mod in (optimized, reference, unsplit):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mod(x)
        assert out.dtype == torch.bfloat16
        if mod is optimized:
            assert weight_grad_nodes(out) == 14
        weighted_sum(out.float()).backward()
    for (name, p), q, u in zip(model.named_parameters(), reference.parameters(), unsplit_model.parameters()):
        assert p.grad.dtype == p.dtype == torch.float32, name
        assert_close_rel(p.grad, q.grad, 2e-2, name)  # bf16, and branch gradients summed in another order
        assert_close_rel(p.grad, u.grad, 1e-6, name)  # the same plan unsplit: the same arithmetic


class Conv2dSubclass(nn.Conv2d):
    pass


class FailClosed(nn.Module):
    """One conv of each kind the split must leave alone, beside one it splits."""

    def __init__(self):
        super().__init__()
        self.shared_a = nn.Conv2d(3, 4, 3, padding=1)
        self.shared_b = nn.Conv2d(3, 4, 3, padding=1)
        self.shared_b.weight = self.shared_a.weight
        self.hooked = nn.Conv2d(3, 4, 3, padding=1)
        self.hooked.register_forward_hook(lambda m, i, o: o * 2)
        self.subclass = Conv2dSubclass(3, 4, 3, padding=1)
        self.reflect = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
        self.uneven = nn.Conv2d(3, 4, 2, padding="same")
        self.twice = nn.Conv2d(3, 3, 1)
        self.plain = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        parts = [self.shared_a(x), self.shared_b(x), self.hooked(x), self.subclass(x), self.reflect(x),
                 self.uneven(x), self.twice(self.twice(x)).repeat(1, 2, 1, 1)[:, :4], self.plain(x)]
        return sum(p.mean() for p in parts)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
def test_fail_closed_shared_weights_hooks_subclasses_and_odd_padding_stay_module_calls():
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    optimized, model, reference = optimized_pair(lambda: FailClosed().double(), x)
    split = {str(n.args[0].target) for n in optimized.plan.generated.graph.nodes
             if n.target is weight_grads.split_forward}
    assert split == {"plain"}
    optimized(x).backward()
    reference(x).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-12, name)


def test_at_call_time_a_new_hook_a_frozen_weight_or_no_grad_get_the_module_call():
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64).requires_grad_()
    optimized, model, reference = optimized_pair(lambda: ConvBranches().double(), x)
    assert optimized.plan.weight_grad_splits == 5
    with torch.no_grad():
        assert weight_grad_nodes(optimized(x).requires_grad_()) == 0
    model.right.weight.requires_grad_(False)
    reference.right.weight.requires_grad_(False)
    fired = []
    handle = model.left.register_forward_hook(lambda m, i, o: fired.append(1))
    out = optimized(x)
    assert fired == [1] and weight_grad_nodes(out) == 3  # stem, mid, head
    weighted_sum(out).backward()
    weighted_sum(reference(x)).backward()
    assert model.right.weight.grad is None
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            assert_close_rel(p.grad, q.grad, 1e-12, name)
    handle.remove()
    with torch.autograd.graph.save_on_cpu():
        assert weight_grad_nodes(optimized(x)) == 0  # saved-tensor hooks would run on the side stream


class _Log(TorchDispatchMode):
    def __init__(self, inside):
        super().__init__()
        self.inside, self.ops = inside, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside[0]:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_nothing_but_aliasing_runs_while_the_weight_gradient_stream_is_current(monkeypatch):
    """Forward records the weight-gradient node on that stream and launches no kernel there."""
    inside, entered = [False], []

    @contextlib.contextmanager
    def on_stream(self):
        entered.append(1)
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    monkeypatch.setattr(StreamRuntime, "on_weight_grad_stream", on_stream)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).requires_grad_()
    optimized, _, _ = optimized_pair(lambda: WideNet(branches=6).double(), x)
    with _Log(inside) as log:
        optimized(x)
    assert len(entered) == 14
    assert log.ops and {str(op) for op in log.ops} <= {"aten.view.default", "aten.detach.default",
                                                       "aten.alias.default"}


class FakeStream:
    def __init__(self, name, priority=0):
        self.name, self.priority = name, priority


def test_runtime_binds_a_lowest_priority_weight_gradient_stream_current_only_inside_the_block(monkeypatch):
    made, current = [], []

    def stream(device=None, priority=0):
        made.append(FakeStream(f"s{len(made)}", priority))
        return made[-1]

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: object())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", current.append)
    rt = StreamRuntime(num_streams=3, num_events=1, weight_grad_stream=True)
    with rt.on_weight_grad_stream():  # not active (CPU): nothing is bound or switched
        pass
    assert made == [] and current == []
    rt._bind("cuda:0")
    weight_stream = rt._weight_grad
    assert len(made) == 3 and weight_stream is made[-1] and weight_stream.priority == 0
    caller = FakeStream("caller")
    rt.active, rt._streams, rt._current = True, [caller, *rt._side], 2
    with rt.on_weight_grad_stream():
        assert current == [weight_stream]
    assert current == [weight_stream, rt._side[1]]  # back to the stream the plan was on
    assert StreamRuntime(2, 0)._weight_grad is None


def test_train_step_with_the_split_trains_like_the_plain_loop():
    torch.manual_seed(0)
    model = WideNet(branches=6)
    ref = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(4)]
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    step = concur.train_step(model, loss_fn, make_opt(model.parameters()), batches[0], streams=4,
                             cuda_graph=False, split_weight_grads=True)
    assert step.module.plan.weight_grad_splits == 14
    losses = [step(x, y).item() for x, y in batches]
    expected = plain_loop(ref, loss_fn, make_opt(ref.parameters()), batches)
    assert losses == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    off = concur.train_step(WideNet(branches=6), loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                            batches[0], streams=4, cuda_graph=False, split_weight_grads=False)
    assert off.module.plan.weight_grad_splits == 0


def test_train_step_splits_by_default_where_the_step_is_captured_or_compiled():
    """Captured or compiled steps pay no host time for the split; an eager unfused step would, each step."""
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))

    def make(**kw):
        model = WideNet(branches=6)
        return concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                                 batch, streams=4, **kw)

    assert make(cuda_graph=True).split_weight_grads is True
    assert make(cuda_graph=False).split_weight_grads is False
    assert make(cuda_graph=False).module.plan.weight_grad_splits == 0
    assert make(cuda_graph=False, compile=True).split_weight_grads is True


def test_train_step_passes_the_option_to_the_fused_path_and_rejects_a_contradiction():
    model = WideNet(branches=2)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = concur.train_step(model, nn.CrossEntropyLoss(), opt, batch, cuda_graph=False, compile=True,
                             split_weight_grads=False)
    assert step.backends[4].options.split_weight_grads is False
    with pytest.raises(ValueError, match="contradicts"):
        concur.train_step(model, nn.CrossEntropyLoss(), opt, batch, cuda_graph=False, compile=True,
                          compile_options={"split_weight_grads": True}, split_weight_grads=False)

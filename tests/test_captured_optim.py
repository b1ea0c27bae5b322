"""concur.training.captured_optim: the device-tensor update is torch's step, follows new hyperparameters, and
costs no more than torch's foreach step.

Costs are counted on the CPU, per step, as the ops dispatched (each foreach op is a few multi-tensor kernels
on a GPU, whatever the number of parameters) and the elements of the tensors they allocate.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from concur import _torch_compat as compat
from concur.training.captured_optim import (DeviceHyperparameters, GroupsWatch, build_update, structure,
                                           unsupported_reason)

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_decay": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_plain_decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    "sgd_maximize": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, maximize=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_the_update_equals_the_optimizers_step_and_reads_a_changed_lr_and_beta_after_refresh(make):
    torch.manual_seed(0)
    reference = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True),
                 torch.randn(3, dtype=torch.float64, requires_grad=True)]
    params = [p.detach().clone().requires_grad_() for p in reference]
    expected_opt, opt = make(reference), make(params)
    for q in params:
        q.grad = torch.zeros_like(q)
    hyper = DeviceHyperparameters(opt)
    update = build_update(opt, hyper, params)  # built once, as a captured graph is
    for _ in range(4):
        for p, q in zip(reference, params):
            p.grad = torch.randn_like(p)
            q.grad.copy_(p.grad)
        expected_opt.step()
        update()
        for o in (expected_opt, opt):  # what a OneCycleLR step does between two replays
            for group in o.param_groups:
                group["lr"] *= 0.5
                group["weight_decay"] *= 2
                if "betas" in group:
                    group["betas"] = (group["betas"][0] - 0.05, group["betas"][1])
                elif group["momentum"]:  # (from zero it would be another update: a new capture)
                    group["momentum"] -= 0.1
        hyper.refresh()
    for p, q in zip(reference, params):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-12)



def test_a_refresh_where_no_group_changed_reads_nothing_and_one_after_any_change_writes_it(monkeypatch):
    """refresh runs before every replay: with the same values it reads no group; a new value, a tensor value
    changed in place, a list of betas changed in place and a reloaded state are all written."""
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.Adam([p], lr=0.1)
    hyper = DeviceHyperparameters(opt)
    lr = hyper.scalar(0, "lr", torch.float64, torch.device("cpu"))
    betas = hyper.scalar(0, "betas", torch.float64, torch.device("cpu"))
    writes = []
    write = DeviceHyperparameters._write
    monkeypatch.setattr(DeviceHyperparameters, "_write", lambda self, key: (writes.append(key), write(self, key)))
    hyper.refresh()
    writes.clear()
    for _ in range(3):
        hyper.refresh()
    assert writes == [], "nothing changed: nothing read"
    opt.param_groups[0]["lr"] = 0.05
    hyper.refresh()
    assert lr.item() == 0.05
    opt.param_groups[0]["betas"] = [0.8, 0.99]
    hyper.refresh()
    opt.param_groups[0]["betas"][0] = 0.7  # the same list, changed in place
    hyper.refresh()
    assert betas[0, 0].item() == 0.7
    opt.param_groups[0]["lr"] = torch.tensor(0.02, dtype=torch.float64)
    hyper.refresh()
    opt.param_groups[0]["lr"].fill_(0.01)  # the same tensor, changed in place
    hyper.refresh()
    assert lr.item() == 0.01
    opt.param_groups[0]["lr"] = 0.3
    hyper.refresh()
    saved = opt.state_dict()
    opt.param_groups[0]["lr"] = 0.4
    hyper.refresh()
    opt.load_state_dict(saved)
    hyper.refresh()
    assert lr.item() == 0.3


def test_a_groups_watch_finds_them_unchanged_only_while_they_hold_the_same_immutable_values():
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    watch = GroupsWatch(opt)
    assert not watch.unchanged(), "the first look"
    assert watch.unchanged() and watch.unchanged()
    opt.param_groups[0]["lr"] = float("0.1")  # equal, another object: read again (the same answer)
    assert not watch.unchanged() and watch.unchanged()
    opt.param_groups[0]["new"] = 1  # a key added
    assert not watch.unchanged() and watch.unchanged()
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    assert not watch.unchanged() and watch.unchanged()
    opt.param_groups[0]["params"].append(torch.zeros(1, requires_grad=True))  # not watched: the graph key has it
    assert watch.unchanged()
    opt.param_groups[1]["lr"] = np.float64(0.05)  # a float too (as a scheduler computing in numpy gives)
    assert not watch.unchanged() and watch.unchanged()
    opt.param_groups[1]["lr"] = torch.tensor(0.1)
    assert not watch.unchanged() and not watch.unchanged(), "a tensor may change in place: never unchanged"


def test_only_plain_sgd_adam_and_adamw_are_supported():
    p = [torch.zeros(2, requires_grad=True)]

    class MySGD(torch.optim.SGD):
        pass

    assert unsupported_reason(torch.optim.SGD(p, lr=0.1)) is None
    assert unsupported_reason(torch.optim.RMSprop(p)) == "RMSprop is not one of SGD, Adam, AdamW"
    assert unsupported_reason(MySGD(p, lr=0.1)) == "MySGD is not one of SGD, Adam, AdamW"


def test_structure_changes_with_nesterov_but_not_with_the_learning_rate():
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9)
    before = structure(opt)
    opt.param_groups[0]["lr"] = 0.5
    assert structure(opt) == before
    opt.param_groups[0]["nesterov"] = True
    assert structure(opt) != before


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched, and the tensors they return that no input owned (temporaries)."""

    def __init__(self):
        super().__init__()
        self.ops, self.new_elements = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func.overloadpacket))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.new_elements += sum(t.numel() for t in pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor) and t.dim() > 0
                                 and t.untyped_storage().data_ptr() not in inputs)
        return out


def _count(step):
    with _CountOps() as counted:
        step()
    return counted


LEAN = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_decay": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_plain_decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-4),
}


@pytest.mark.parametrize("make", LEAN.values(), ids=LEAN.keys())
def test_sgd_dispatches_no_more_ops_and_temporaries_than_torchs_foreach_step(make):
    """The captured SGD update against torch's own foreach ``step()`` (float ``lr``, what the recipe captures).

    Counted in ops dispatched per step (each a few multi-tensor kernels on a GPU, whatever the number of
    parameters) and in elements of the tensors the step allocates.
    """
    torch.manual_seed(0)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    for a, b in zip(ref, ours):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    torch_opt, opt = make(ref), make(ours)
    foreach = dict(foreach=True)
    for g in torch_opt.param_groups:
        g.update(foreach)
    torch_opt.step()  # state exists from here on, as in a step after the first
    update = build_update(opt, DeviceHyperparameters(opt), ours)
    update()
    theirs, mine = _count(torch_opt.step), _count(update)
    scalar_ops = {"aten.stack", "aten._to_copy", "aten.pow", "aten.rsub", "aten.sub", "aten.sqrt", "aten.div",
                  "aten.neg", "aten.unbind", "aten.lift_fresh", "aten.detach", "aten.copy_", "aten.clone"}
    per_parameter = lambda ops: [o for o in ops if o not in scalar_ops]  # noqa: E731
    assert len(per_parameter(mine.ops)) <= len(per_parameter(theirs.ops)), (mine.ops, theirs.ops)
    assert mine.new_elements <= theirs.new_elements, (mine.new_elements, theirs.new_elements)


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)],
                         ids=["adamw", "adam"])
def test_adam_allocates_no_more_than_torchs_capturable_step_with_tensor_betas(make):
    """Adam's captured update makes the two gradient-sized temporaries torch's capturable foreach Adam makes
    when ``beta2`` is a tensor (``scaled_device_grads`` and ``exp_avg_sq_sqrt``), and no third.

    (A capturable step runs on CUDA only, so its count cannot be taken here: the bound is read off its code.)
    """
    torch.manual_seed(0)
    params = [torch.randn(s, requires_grad=True) for s in [(16, 8), (16,), (4, 16)]]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params)
    update = build_update(opt, DeviceHyperparameters(opt), params)
    update()
    per_parameter_scalars = 16 * len(params)  # bias corrections: vectors of one value per parameter
    assert _count(update).new_elements <= 2 * sum(p.numel() for p in params) + per_parameter_scalars


# ---------------------------------------------------------------- Adam against torch's step: ops, temporaries, numbers

SHAPES = [(16, 8), (16,), (4, 16), (8, 3, 3)]  # none of them (4,) or (2, 4): the step-count vectors
UNCOUNTED = {"aten.lift_fresh", "aten.detach", "aten.unbind", "aten.select", "aten.alias", "prim.device",
             "profiler._record_function_enter_new", "profiler._record_function_exit"}


class _Count(TorchDispatchMode):
    """Ops on parameter-sized tensors, ops on scalars only, host reads, and new parameter-sized elements."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = {torch.Size(s) for s in shapes}
        self.per_parameter, self.scalar, self.host_reads, self.new_elements = [], [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name == "aten._local_scalar_dense":
            self.host_reads += 1
        elif name not in UNCOUNTED:
            ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            sized = [t for t in ins + outs if t.shape in self.shapes]
            (self.per_parameter if sized else self.scalar).append(name)
            owned = {t.untyped_storage().data_ptr() for t in ins}
            self.new_elements += sum(t.numel() for t in outs
                                     if t.shape in self.shapes and t.untyped_storage().data_ptr() not in owned)
        return out


def _counts(make):
    """Count one step of torch's foreach ``step()`` and of the captured update, each after a first step."""
    torch.manual_seed(0)
    ref = [torch.randn(s, requires_grad=True) for s in SHAPES]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    for a, b in zip(ref, ours):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    torch_opt, opt = make(ref, foreach=True), make(ours)
    torch_opt.step()
    update = build_update(opt, DeviceHyperparameters(opt), ours)
    update()
    counted = []
    for step in (torch_opt.step, update):
        with _Count(SHAPES) as c:
            step()
        counted.append(c)
    return counted


ADAM = {
    "adam": lambda p, **kw: torch.optim.Adam(p, lr=1e-3, **kw),
    "adamw": lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw),
    "adamw_no_decay": lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0, **kw),
    "adam_maximize": lambda p, **kw: torch.optim.Adam(p, lr=1e-3, maximize=True, **kw),
    "adam_decay_maximize": lambda p, **kw: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01, maximize=True, **kw),
    "adamw_amsgrad": lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, **kw),
    "adamw_amsgrad_maximize": lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, maximize=True, **kw),
}


@pytest.mark.parametrize("make", ADAM.values(), ids=ADAM.keys())
def test_adam_dispatches_no_more_ops_and_temporaries_than_torchs_foreach_step(make):
    theirs, mine = _counts(make)
    assert len(mine.per_parameter) <= len(theirs.per_parameter), (mine.per_parameter, theirs.per_parameter)
    assert mine.new_elements <= theirs.new_elements, (mine.new_elements, theirs.new_elements)
    # torch reads each step count on the host (two .item() per parameter); the captured update cannot
    assert mine.host_reads == 0
    # its bias corrections: kernels over one vector of step counts, as many as torch's capturable step launches
    assert len(mine.scalar) <= 9, mine.scalar


def test_adams_l2_decay_costs_at_most_one_op_more_than_torchs_and_no_temporary_more():
    """torch adds ``wd*p`` to the gradient in one op with ``wd`` a host number; read from the device it takes two."""
    theirs, mine = _counts(lambda p, **kw: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01, **kw))
    assert len(mine.per_parameter) <= len(theirs.per_parameter) + 1, (mine.per_parameter, theirs.per_parameter)
    assert mine.new_elements <= theirs.new_elements


NUMERICS = {
    "adam": lambda p, **kw: torch.optim.Adam(p, lr=0.01, **kw),
    "adam_decay": lambda p, **kw: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, **kw),
    "adamw": lambda p, **kw: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, **kw),
    "adam_decay_maximize": lambda p, **kw: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, maximize=True, **kw),
    "adamw_maximize": lambda p, **kw: torch.optim.AdamW(p, lr=0.01, maximize=True, **kw),
    "adamw_amsgrad": lambda p, **kw: torch.optim.AdamW(p, lr=0.01, amsgrad=True, **kw),
}


@pytest.mark.parametrize("make", NUMERICS.values(), ids=NUMERICS.keys())
def test_adam_equals_torchs_step_under_one_cycle_with_parameters_of_different_step_counts(make):
    """float64, OneCycleLR moving lr and beta1 every step, lr 0 at the last step, and one parameter that
    sat out the first two steps (so it has taken fewer), against torch's foreach and for-loop steps."""
    torch.manual_seed(0)
    shapes = [(5, 3), (3,), (2, 5)]
    ref = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    loop = [p.detach().clone().requires_grad_() for p in ref]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    opts = [make(ref, foreach=True), make(loop, foreach=False), make(ours)]
    lrs = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8, pct_start=0.5) for o in opts]
    update = None
    for i in range(8):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for params in (ref, loop, ours):
            for j, p in enumerate(params):
                p.grad = None if i < 2 and j == 2 else grads[j].clone()
        if i == 2:  # built once, as a graph is captured once; ours[2] has no state yet
            hyper = DeviceHyperparameters(opts[2])
            update = build_update(opts[2], hyper, ours)
        if i == 7:
            for o in opts:
                o.param_groups[0]["lr"] = 0.0
        opts[0].step()
        opts[1].step()
        if update is None:
            opts[2].step()
        else:
            hyper.refresh()
            update()
        for s in lrs:
            s.step()
    for theirs in (ref, loop):
        for p, q in zip(theirs, ours):
            torch.testing.assert_close(q, p, rtol=1e-13, atol=1e-15)
    for p, q in zip(ref, ours):
        for name, value in opts[0].state[p].items():
            torch.testing.assert_close(opts[2].state[q][name], value, rtol=1e-13, atol=1e-15)


def test_a_tensor_beta2_is_read_where_it_lives():
    """A tensor beta2 changed in place between steps reaches the built update (torch's for-loop step reads it too)."""
    torch.manual_seed(0)
    ref = [torch.randn(5, 3, dtype=torch.float64, requires_grad=True)]
    ours = [ref[0].detach().clone().requires_grad_()]
    betas = [(torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.99, dtype=torch.float64)) for _ in range(2)]
    torch_opt = torch.optim.Adam(ref, lr=0.01, betas=betas[0], weight_decay=0.1, foreach=False)
    opt = torch.optim.Adam(ours, lr=0.01, betas=betas[1], weight_decay=0.1)
    ours[0].grad = torch.zeros_like(ours[0])
    hyper = DeviceHyperparameters(opt)
    update = build_update(opt, hyper, ours)
    for beta2 in (0.99, 0.95, 0.999, 0.9):
        for b in betas:
            b[1].fill_(beta2)
        ref[0].grad = torch.randn_like(ref[0])
        ours[0].grad.copy_(ref[0].grad)
        torch_opt.step()
        hyper.refresh()
        update()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_sgd", "fallback"])
@pytest.mark.parametrize("negate", [False, True])
def test_foreach_lerp_is_torchs_lerp(fused, negate, monkeypatch):
    """With aten's fused SGD, and without it (older torch; float64 on CUDA), the same numbers as torch.lerp."""
    if not fused:
        monkeypatch.setattr(compat, "_fused_sgd_tensor_lr", lambda: None)
    torch.manual_seed(0)
    xs = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    ys = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    expected = [torch.lerp(x, -y if negate else y, 0.1) for x, y in zip(xs, ys)]
    compat.foreach_lerp_(xs, ys, torch.tensor(0.1, dtype=torch.float64), negate=negate)
    for x, e in zip(xs, expected):
        torch.testing.assert_close(x, e, rtol=1e-15, atol=1e-16)

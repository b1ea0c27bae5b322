"""concur.training.captured_optim: the device-tensor update is torch's step, and follows new hyperparameters."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from concur.training.captured_optim import DeviceHyperparameters, build_update, structure, unsupported_reason

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

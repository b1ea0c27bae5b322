"""concur.training.captured_optim: the device-tensor update is torch's step, and follows new hyperparameters."""

from __future__ import annotations

import pytest
import torch

from concur.training.captured_optim import DeviceHyperparameters, build_update, structure, unsupported_reason

OPTIMIZERS = {
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
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
    grads = {p: torch.zeros_like(p) for p in params}
    hyper = DeviceHyperparameters(opt)
    update = build_update(opt, hyper, grads)  # built once, as a captured graph is
    for _ in range(4):
        for p, q in zip(reference, params):
            p.grad = torch.randn_like(p)
            grads[q].copy_(p.grad)
        expected_opt.step()
        update()
        for o in (expected_opt, opt):  # what a OneCycleLR step does between two replays
            for group in o.param_groups:
                group["lr"] *= 0.5
                if "betas" in group:
                    group["betas"] = (group["betas"][0] - 0.05, group["betas"][1])
                else:
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

"""GPU tests of concur.fx.pool_indices (run on the device machine): GoogLeNet's plan on 4 streams with
``lean_pools`` holds less memory after forward by its pools' int64 indices, and computes the same step; its
steps on 4 streams show no race under PyTorch's CUDA sanitizer.

    python -m pytest -q -m cuda tests/test_gpu_pool_indices.py
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torchvision

import concur
from tests.conftest import assert_close_rel, requires_cuda
from tests.test_gpu import _sanitized

pytestmark = [pytest.mark.cuda, requires_cuda]


def _index_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """The bytes of int64 indices the model's max-pooling layers save in a plain forward."""
    sizes = []
    hooks = [m.register_forward_hook(lambda m, i, o: sizes.append(o.numel() * 8))
             for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        model(x)
    for h in hooks:
        h.remove()
    return sum(sizes)


def test_googlenet_on_4_streams_with_lean_pools_holds_less_by_the_indices_and_computes_the_same_step():
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).cuda()
    model.dropout.p = 0.0  # the two plans' steps compare without a dropout mask between them
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(32, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    indices = _index_bytes(model, x)
    alive, grads = {}, {}
    for lean in (False, True):
        module = concur.optimize(model, (x,), streams=4, measure=False, lean_pools=lean)
        assert module.plan.schedule.num_streams > 1 and module.plan.pool_recomputes == (13 if lean else 0)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16):
            out = module(x)
        torch.cuda.synchronize()
        alive[lean] = torch.cuda.memory_allocated() - before
        out.float().square().mean().backward()
        grads[lean] = [p.grad.float().clone() for p in model.parameters()]
        del out, module
    saved = alive[False] - alive[True]
    print(f"alive after forward: {alive[False] / 2**20:.0f} MiB plain, {alive[True] / 2**20:.0f} MiB lean; "
          f"indices {indices / 2**20:.0f} MiB")
    assert saved >= 0.9 * indices, f"saved {saved} bytes, the pools' indices are {indices}"
    for a, b in zip(grads[False], grads[True]):
        assert_close_rel(b, a, 2e-2, "a parameter's gradient, lean against plain")


def test_the_lean_plan_on_4_streams_shows_no_race_under_the_sanitizer():
    run = _sanitized("--model", "googlenet", "--lean-pools")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "CSAN" not in run.stderr
    found = re.search(r"streams (\d+), pools saving no indices (\d+)", run.stdout)
    assert found and int(found[1]) > 1 and int(found[2]) == 13, run.stdout[-500:]

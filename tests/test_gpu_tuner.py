"""On a GPU: the measured tuner on GoogLeNet b8."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchvision

import concur
from concur.observe.tuner import tune_train_step
from tests.conftest import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def googlenet_b8():
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).cuda().train()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (8,), device="cuda")
    return model, x, y


def test_tuner_on_googlenet_b8_is_never_slower_than_serial_leaves_the_model_alone_and_caches(tmp_path):
    model, x, y = googlenet_b8()
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()  # momentum buffers exist: tuning must not touch them
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    rng = torch.cuda.get_rng_state()

    result = tune_train_step(model, loss_fn, opt, (x, y), make_step=concur.train_step, cache_dir=tmp_path, budget_s=20, progress=True)
    print(f"\nchose {result.config.label}: {result.measurement} vs serial {result.baseline}; {result.stopped}; "
          f"lever {result.lever} (eager utilization {result.eager_utilization}); {result.seconds:.1f} s")
    assert result.baseline is not None and result.measurement is not None
    assert result.measurement.median_ms <= result.baseline.median_ms
    assert result.seconds <= 25, "the budget is 20 s; one trial may overrun it a little"
    if result.eager_utilization is not None:  # NVML present: eager GoogLeNet b8 is launch-bound
        assert result.eager_utilization < 60 and result.lever == "capture"
    assert not [t for t in result.trials if t.error and t.config.streams <= 4], result.trials

    after = (model.state_dict(), opt.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    for p, s in before[1]["state"].items():
        assert torch.equal(s["momentum_buffer"], after[1]["state"][p]["momentum_buffer"])
    assert torch.equal(rng, torch.cuda.get_rng_state())

    again = tune_train_step(model, loss_fn, opt, (x, y), make_step=concur.train_step, cache_dir=tmp_path, budget_s=20, progress=False)
    assert again.from_cache and again.config == result.config

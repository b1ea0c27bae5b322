"""On the GPU: train_step(compile=True) decides its streams on the captured step (concur.training.step_streams).

    PYTHONPATH=. python -m pytest -q -s -m cuda tests/test_gpu_step_streams.py
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import concur
from tests.conftest import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def _googlenet(batch: int):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.googlenet(aux_logits=False, init_weights=True, dropout=0.0).cuda().train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    return model, x, y


def _steps(step, x, y, n=3):
    return [step(x, y).item() for _ in range(n)]


def test_the_step_times_its_plans_once_trains_as_eager_and_a_second_setup_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CONCUR_MEASURE", raising=False)
    # timing takes turns with any other process on the GPU (tests side by side), so the decision is reused below
    monkeypatch.setenv("CONCUR_MEASURE_LOCK", os.environ.get("CONCUR_MEASURE_LOCK", str(tmp_path / "turns.lock")))
    torch._dynamo.reset()
    model, x, y = _googlenet(16)
    plain, again = copy.deepcopy(model), copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    step = concur.train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), (x, y),
                             compile=True)
    losses = _steps(step, x, y)
    (decision,) = step.step_decisions
    assert decision.source == "measurement" and decision.measured is not None, decision
    print(f"\nGoogLeNet b16 fp32, the step: {decision.reason}")
    backend = step.backends[4]
    on_streams = [g for g in backend.graphs if g.num_streams > 1]
    assert bool(on_streams) == decision.keep, backend.graphs

    opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    expected = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(plain(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    torch.testing.assert_close(losses, expected, rtol=2e-2, atol=2e-2)  # TF32 convolutions, fused kernels

    torch._dynamo.reset()
    second = concur.train_step(again, loss_fn, torch.optim.SGD(again.parameters(), lr=0.01, momentum=0.9), (x, y),
                               compile=True)
    _steps(second, x, y, 1)
    (cached,) = second.step_decisions
    assert cached.source == "cache" and cached.keep == decision.keep, cached
    torch._dynamo.reset()

"""GPU tests of the fused path (torch.compile backend "concur"): training equality and CSAN.

Written for the H100 run; each model compiles twice (2-4 minutes each there).
Inductor's numerics differ from eager's, and training amplifies any difference,
so the reference envelope is plain ``torch.compile`` (``streams=1``, the same
path) against eager: concur's segments on streams may add no more than 4x that.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import concur
from tests.conftest import requires_cuda
from tests.test_gpu import MODELS, ROOT, _loss, _train, exact_math  # noqa: F401 - exact_math is a fixture

pytestmark = [pytest.mark.cuda, requires_cuda]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_train_step_matches_eager_within_compiles_own_envelope(name):
    torch._inductor.config.fallback_random = True  # dropout masks as in eager
    make, size, batch = MODELS[name]
    torch.manual_seed(0)
    base = make().cuda().train()
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(batch, 3, size, size, device="cuda", generator=g),
                torch.randint(0, 1000, (batch,), device="cuda", generator=g)) for _ in range(50)]
    make_opt = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    results = {}
    for streams in (1, 4):
        model = copy.deepcopy(base)
        opt = make_opt(model.parameters())
        step = concur.train_step(model, _loss, opt, batches[0], streams=streams, compile=True)
        results[streams] = torch.tensor(_train(model, opt, batches, step))
        if streams == 4:
            infos = step.backends[4].graphs
            assert all(i.fallback_reason is None for i in infos), infos
            assert max(i.num_streams for i in infos) > 1, "the fused graphs must use several streams"
        torch._dynamo.reset()
    ref = copy.deepcopy(base)
    expected = torch.tensor(_train(ref, make_opt(ref.parameters()), batches))
    deviation = ((results[4] - expected).abs() / expected.abs()).cummax(0).values
    allowed = 4 * ((results[1] - expected).abs() / expected.abs()).cummax(0).values + 1e-4
    print(f"{name}: fused deviation {deviation[-1]:.2e}, compile's own {allowed[-1]:.2e}")
    assert deviation[0] < 1e-4 and (deviation <= allowed).all()


@pytest.mark.parametrize("model_flag", [[], ["--inception"]], ids=["googlenet", "inception_v3"])
def test_fused_path_under_the_sanitizer_reports_no_race(model_flag):
    result = subprocess.run([sys.executable, "-m", "tests.gpu_sanitized_run", "--compile", *model_flag],
                            cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sanitized run finished" in result.stdout

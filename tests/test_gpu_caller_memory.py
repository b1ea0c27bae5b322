"""GPU tests of concur.caller_memory (run on the device machine): a plan's side-stream ops launched from below
autograd, their large outputs made on the caller's stream, the whole backward there.

- float64 outputs and gradients of GoogLeNet (convolutions, batch norms on cuDNN, left on their stream, max
  pooling, concatenations) equal the original model's, and the handlers made outputs on the caller's stream;
- under bf16 autocast and channels-last (batch norms on torch's kernel) the outputs and gradients equal the plain
  plan's, over several steps, and the mode is left after each call.

GoogLeNet without dropout: two runs of it draw different masks.

    python -m pytest -q -m cuda tests/test_gpu_caller_memory.py
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import concur  # noqa: E402
from concur import caller_memory  # noqa: E402
from tests.conftest import assert_close_rel, requires_cuda  # noqa: E402
from tests.test_gpu import exact_math  # noqa: E402,F401 - exact_math is an autouse fixture

pytestmark = [pytest.mark.cuda, requires_cuda]


def _googlenet(dtype: torch.dtype) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False,
                                        dropout=0.0).cuda().to(dtype).train()


def _counting(monkeypatch) -> list:
    moved: list = []
    output = caller_memory.CallerMemory.output
    monkeypatch.setattr(caller_memory.CallerMemory, "output",
                        lambda self, *a: moved.append(self.launch) or output(self, *a))
    return moved


def test_float64_outputs_and_gradients_equal_the_original_and_outputs_were_made_on_the_callers_stream(monkeypatch):
    moved = _counting(monkeypatch)
    model = _googlenet(torch.float64)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64, device="cuda", dtype=torch.float64)
    optimized = concur.optimize(model, (x,), streams=4, caller_memory=True, split_weight_grads=True, measure=False)
    assert optimized.plan.runtime.caller_memory and optimized.schedule.num_streams > 1
    moved.clear()
    out = optimized(x)
    assert moved and all(stream is not None for stream in moved)
    expected = reference(x)
    (out * 1.5).sum().backward()
    (expected * 1.5).sum().backward()
    torch.cuda.synchronize()
    assert_close_rel(out, expected, 1e-10, "output")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-9, name)


def test_bf16_channels_last_outputs_and_gradients_equal_the_plain_plans(monkeypatch):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    moved = _counting(monkeypatch)
    models = [_googlenet(torch.float32).to(memory_format=torch.channels_last) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(8, 3, 96, 96, device="cuda").to(memory_format=torch.channels_last)
    plans = [concur.optimize(m, (x,), streams=4, caller_memory=c, split_weight_grads=True, measure=False)
             for m, c in zip(models, (True, False))]
    assert plans[0].plan.runtime.caller_memory and not plans[1].plan.runtime.caller_memory
    for _ in range(3):
        outs = []
        for plan in plans:
            moved.clear()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = plan(x)
            assert bool(moved) == plan.plan.runtime.caller_memory and _get_current_dispatch_mode_stack() == []
            out.float().sum().backward()
            outs.append(out.float())
        torch.cuda.synchronize()
        assert_close_rel(outs[0], outs[1], 1e-2, "output")
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert_close_rel(p.grad, q.grad, 2e-2, name)

"""Train a few steps of the fused path (torch.compile, backend "concur") under CUDA's sanitizer; exit 0 if no race.

Usage: python -m tests.gpu_fused_sanitized_run --model NAME [--no-buffer-reuse] [--steps N]
NAME is a key of tests.gpu_fused_models.FUSED_MODELS. The model is
channels-last and every graph that can be is put on 4 streams
(``min_predicted_speedup=1.0``), so the sanitizer sees the streams the plan
uses. CSAN cannot be switched off once on, so the GPU tests run this in a
subprocess.
"""

from __future__ import annotations

import argparse

import torch

import concur
from concur._torch_compat import cuda_sanitizer
from tests.gpu_fused_models import FUSED_MODELS
from tests.test_gpu import _loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, choices=sorted(FUSED_MODELS))
    p.add_argument("--no-buffer-reuse", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    make, size, batch = FUSED_MODELS[a.model]
    with cuda_sanitizer():
        torch.manual_seed(0)
        cl = torch.channels_last
        model = make().cuda().train().to(memory_format=cl)
        x = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=cl)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step = concur.train_step(model, _loss, opt, (x, y), streams=4, cuda_graph=False, compile=True,
                                 compile_options={"min_predicted_speedup": 1.0,
                                                  "buffer_reuse": not a.no_buffer_reuse})
        for _ in range(a.steps):
            loss = step(torch.randn_like(x), y)
        torch.cuda.synchronize()
    graphs = [g for b in step.backends.values() for g in b.graphs]
    print(f"sanitized run finished, loss {loss.item():.4f}, streams {[g.num_streams for g in graphs]}, "
          f"fallbacks {[g.fallback_reason for g in graphs if g.fallback_reason]}")


if __name__ == "__main__":
    main()

"""Train a few steps of the fused path (torch.compile, backend "concur") under CUDA's sanitizer; exit 0 if no race.

Usage: python -m tests.gpu_fused_sanitized_run --model NAME [--no-buffer-reuse | --ordered-reuse] [--steps N]
                                                [--narrowed N]
NAME is a key of tests.gpu_fused_models.FUSED_MODELS. The model is
channels-last and every graph that can be is put on 4 streams
(``min_predicted_speedup=1.0``), so the sanitizer sees the streams the plan
uses; with ``--narrowed N`` the backward graphs' programs are then taken
down N steps, as where the step did not fit in memory
(``ConcurBackend.narrow_plans``: 1, on 2 streams; 2, on 2 with aten's calls on the
caller's stream). CSAN cannot be switched off once on, so the GPU tests run this in a
subprocess.
"""

from __future__ import annotations

import argparse
import os

import torch

import concur
from concur._torch_compat import cuda_sanitizer
from concur.streams import StreamRuntime
from tests.gpu_fused_models import FUSED_MODELS
from tests.test_gpu import _loss

# The sanitizer checks the multi-stream plan, so it is not left to a timing: under CSAN every kernel launch is
# slowed by its bookkeeping, and a measured decision would keep one stream and leave nothing to check.
os.environ.setdefault("CONCUR_MEASURE", "0")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, choices=sorted(FUSED_MODELS))
    reuse = p.add_mutually_exclusive_group()
    reuse.add_argument("--no-buffer-reuse", action="store_true")
    reuse.add_argument("--ordered-reuse", action="store_true", help='buffer_reuse="ordered"')
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--narrowed", type=int, default=0, metavar="STEPS",
                   help="the backward graphs taken down STEPS steps (1: on 2 streams; 2: on 2, aten's calls on the caller's)")
    a = p.parse_args()
    make, size, batch = FUSED_MODELS[a.model]
    torch.manual_seed(0)
    cl = torch.channels_last
    model = make().cuda().train().to(memory_format=cl)
    x = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=cl)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = concur.train_step(model, _loss, opt, (x, y), streams=4, cuda_graph=False, compile=True,
                             compile_options={"min_predicted_speedup": 1.0,
                                              "buffer_reuse": "ordered" if a.ordered_reuse
                                              else not a.no_buffer_reuse})
    # Dynamo neither compiles nor runs compiled code while a dispatch mode such as the sanitizer is
    # active (the steps would run eagerly, on one stream): the sanitizer's mode is declared to
    # ignore compile internals, so dynamo runs the fused code and the sanitizer sees the aten
    # launches and stream events it issues (not triton's kernels, which it cannot see). The first
    # step compiles outside the sanitizer.
    from torch.cuda import _sanitizer
    from torch.utils._python_dispatch import TorchDispatchMode
    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):
        raise SystemExit(f"torch {torch.__version__} cannot run compiled code under the sanitizer")
    _sanitizer.CUDASanitizerDispatchMode.ignore_compile_internals = classmethod(lambda cls: True)
    step(x, y)
    torch.cuda.synchronize()
    (backend,) = step.backends.values()
    for _ in range(a.narrowed):
        if backend.narrow_plans("narrowed for the sanitizer") in ("", "on 1 stream"):
            raise SystemExit(f"no backward graph kept several streams: {backend.graphs}")
    graphs = [g for b in step.backends.values() for g in b.graphs]
    streams = [g.num_streams for g in graphs]
    if not streams or max(streams) < 2:
        raise SystemExit(f"the fused graphs use no side stream ({streams}): the sanitizer would check nothing")
    forks = [0]
    fork = StreamRuntime.fork

    def counted_fork(self, *args):
        forks[0] += 1
        return fork(self, *args)

    StreamRuntime.fork = counted_fork  # each placed graph forks its side streams once per call
    with cuda_sanitizer():
        for _ in range(a.steps):
            loss = step(torch.randn_like(x), y)
        torch.cuda.synchronize()
    if forks[0] == 0:
        raise SystemExit("no placed graph ran under the sanitizer (the steps ran without concur's streams)")
    after = [g for b in step.backends.values() for g in b.graphs]
    if len(after) != len(graphs):
        raise SystemExit(f"the steps under the sanitizer compiled again ({len(graphs)} -> {len(after)} graphs): "
                         "they did not run the fused code checked above")
    print(f"sanitized run finished, loss {loss.item():.4f}, streams {streams}, "
          f"placed graphs run {forks[0]}, backward streams {[g.num_streams for g in graphs if g.is_backward]}, "
          f"fallbacks {[g.fallback_reason for g in graphs if g.fallback_reason]}")

if __name__ == "__main__":
    main()

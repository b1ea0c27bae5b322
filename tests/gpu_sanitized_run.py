"""Run concurrent forward+backward steps under PyTorch's CUDA sanitizer (CSAN); exit 0 if no race.

Usage: python -m tests.gpu_sanitized_run [--plant-missing-wait] [--model googlenet|inception_v3|resnet50] [--compile]
                                        [--no-buffer-reuse] [--lean-pools] [--caller-outputs FORM]
``--compile`` runs the fused path (torch.compile with the concur backend) without a graph;
``--no-buffer-reuse`` compiles it with ``buffer_reuse=False``; ``--lean-pools`` plans the unfused path's
max-pooling layers to save no indices (``concur.training.rungs.LEAN_POOLS_FIRST``); ``--caller-outputs FORM`` runs
the unfused path under experiments/caller_outputs.py's probe (``outputs`` or ``backward-on-caller``).
CSAN cannot be switched off once on, so the GPU tests run this in a subprocess.
"""

import os
import sys

import torch
import torchvision

import concur
from concur._torch_compat import cuda_sanitizer
from concur.streams import StreamRuntime
from concur.training import rungs

# The sanitizer checks the multi-stream plan, so it is not left to a timing: under CSAN every kernel launch is
# slowed by its bookkeeping, and a measured decision would keep one stream and leave nothing to check.
os.environ.setdefault("CONCUR_MEASURE", "0")

rungs.LEAN_POOLS_FIRST = "--lean-pools" in sys.argv
if "--caller-outputs" in sys.argv:
    from experiments import caller_outputs
    caller_outputs.install(sys.argv[sys.argv.index("--caller-outputs") + 1])
if "--plant-missing-wait" in sys.argv:
    StreamRuntime.wait = lambda self, event: None  # the planted bug CSAN must report

with cuda_sanitizer():
    torch.manual_seed(0)
    name = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "googlenet"
    options = {} if name == "resnet50" else {"aux_logits": False, "init_weights": False}
    model = torchvision.models.get_model(name, weights=None, **options).cuda().train()
    size = 75 if name == "inception_v3" else 64
    x = torch.randn(4, 3, size, size, device="cuda")
    y = torch.randint(0, 1000, (4,), device="cuda")
    fused = "--compile" in sys.argv
    if fused:  # channels-last, and every branchy graph cut: the sanitizer must see the streams
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    step = concur.train_step(model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01,
                             momentum=0.9), (x, y), streams=4, cuda_graph=False, compile=fused,
                             compile_options={"min_predicted_speedup": 1.0,
                                              "buffer_reuse": "--no-buffer-reuse" not in sys.argv} if fused else None)
    for _ in range(2):
        loss = step(torch.randn_like(x), y)
    torch.cuda.synchronize()
    streams = [g.num_streams for b in step.backends.values() for g in b.graphs] if step.compile \
        else step.module.schedule.num_streams
    pools = 0 if step.compile else step.module.plan.pool_recomputes
    moved = dict(caller_outputs.COUNTS) if "--caller-outputs" in sys.argv else {}
    print(f"sanitized run finished, loss {loss.item():.4f}, streams {streams}, pools saving no indices {pools}"
          + (f", caller outputs {moved}" if moved else ""))

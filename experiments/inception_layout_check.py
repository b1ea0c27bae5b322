"""Does eager Inception-v3 compute the same first SGD update in NCHW and channels-last? (GPU check)

    PYTHONPATH=. python3 experiments/inception_layout_check.py

Ran on the H100 (torch 2.11, 2026-11-23): no. Channels-last vs NCHW 0.71 (0.81 with
TF32), NCHW vs itself 2.2e-4, so the 0.716 below is eager's own layout difference.

The fused GPU test found torch.compile's first update 0.716 (relative) away from
eager's on a channels-last Inception-v3, where NCHW gave 2.7e-2. This compares
eager against eager across the two layouts, no compiler involved.
"""

import copy

import torch

from tests.test_gpu import MODELS, _loss

make, size, batch = MODELS["inception_v3"]
torch.manual_seed(0)
base = make().cuda().train()
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(batch, 3, size, size, device="cuda", generator=g)
y = torch.randint(0, 1000, (batch,), device="cuda", generator=g)


def first_update(layout: torch.memory_format, tf32: bool) -> torch.Tensor:
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    model = copy.deepcopy(base).to(memory_format=layout)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    opt.zero_grad()
    _loss(model(x.to(memory_format=layout)), y).backward()
    opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


for tf32 in (False, True):
    nchw, cl = first_update(torch.contiguous_format, tf32), first_update(torch.channels_last, tf32)
    again = first_update(torch.contiguous_format, tf32)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"tf32={tf32}: channels-last vs NCHW {rel(cl, nchw):.3e}; NCHW vs itself {rel(again, nchw):.3e}")

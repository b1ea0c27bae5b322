"""concur inside DistributedDataParallel on 2 GPUs with NCCL, eager and as a captured CUDA graph.

Why there is no race between DDP's all-reduce and concur's side streams
(torch >= 2.4; the reasoning the test checks):

1. DDP's Reducer creates and keeps every parameter's AccumulateGrad node when
   DDP is constructed. An autograd node runs on the stream that was current
   when it was created, so all of them run on the stream DDP was built on,
   which is also the caller's stream that concur forks from and joins to.
2. Backward ops run on their forward op's stream, i.e. on concur's side
   streams; before a node runs, the autograd engine makes the node's stream
   wait for the streams that produced its incoming gradients. So when an
   AccumulateGrad node (and DDP's hook on it) runs, that parameter's
   gradient is complete on the DDP stream.
3. DDP's hook copies the gradient into its bucket on that stream and, when
   the bucket is full, calls the all-reduce, whose NCCL stream waits on the
   current (DDP) stream. The Reducer itself does no cross-stream sync (see the
   TODO in torch/csrc/distributed/c10d/reducer.hpp), which is why (1) matters:
   construct DDP *before* running the ConcurModule with a live autograd graph
   (otherwise DDP would adopt AccumulateGrad nodes created on side streams).

One tower's backward sleeps ~20 ms on its side stream before producing its
parameters' gradients, so an all-reduce that did not wait for them would
reduce stale values and the comparison with plain DDP would fail.

CUDA graphs follow PyTorch's rules for capturing DDP ("CUDA Graphs > Usage with
DistributedDataParallel"): NCCL >= 2.9.6, DDP constructed in a side-stream
context, at least 11 eager DDP iterations before capture, and capture on that
same stream (so the AccumulateGrad nodes DDP holds belong to the capture).

Run on a 2-GPU machine:
    python -m pytest -q -m cuda tests/test_gpu_ddp.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import concur
from tests.models import conv_bn
from tests.test_ddp import WORLD, batch, check_results, run_workers, train

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

SLEEP_CYCLES = 40_000_000  # ~20 ms at 2 GHz


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(SLEEP_CYCLES)  # on the stream of the forward op: a concur side stream
        return grad * 1.0


class SleepyBackward(nn.Module):
    """Identity whose backward delays everything upstream of it on its stream."""

    def forward(self, x):
        return _SleepInBackward.apply(x)


class SleepyWide(nn.Module):
    """Four towers; the backward of the deepest one sleeps before its parameters get gradients."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = conv_bn(3, c)
        self.towers = nn.ModuleList([
            nn.Sequential(conv_bn(c, c), conv_bn(c, c), SleepyBackward()),
            nn.Sequential(conv_bn(c, c)),
            nn.Sequential(conv_bn(c, c), conv_bn(c, c)),
            nn.Sequential(conv_bn(c, c)),
        ])
        self.head = nn.Linear(4 * c, 10)

    def forward(self, x):
        s = self.stem(x)
        y = torch.cat([t(s) for t in self.towers], dim=1)
        return self.head(F.adaptive_avg_pool2d(y, 1).flatten(1))


def make_sleepy() -> nn.Module:
    torch.manual_seed(0)
    return SleepyWide().train()


def train_graphed(rank: int, use_concur: bool, steps: int = 14, warmup: int = 11) -> dict:
    """DDP training whose steps after ``warmup`` eager ones replay one captured CUDA graph."""
    device = torch.device("cuda", rank)
    model = make_sleepy().to(device)
    module = model
    if use_concur:
        module = concur.optimize(model, (batch(0, rank, f"cuda:{rank}")[0],), streams=4,
                                 leaf_modules=[SleepyBackward], measure=False)  # as train() in tests/test_ddp.py
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    losses = []

    def step(x, y):
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss

    with torch.cuda.stream(side):  # DDP's AccumulateGrad nodes are created on the capture stream
        ddp = DDP(module, device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for i in range(warmup):
            x, y = (t.to(device) for t in batch(i, rank, "cpu"))
            opt.zero_grad(set_to_none=True)
            losses.append(step(x, y).item())
    torch.cuda.current_stream(device).wait_stream(side)
    static_x, static_y = (t.to(device) for t in batch(warmup, rank, "cpu"))
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph, stream=side):
        static_loss = step(static_x, static_y)
    for i in range(warmup, steps):
        x, y = batch(i, rank, "cpu")
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses.append(static_loss.item())
    torch.cuda.synchronize(device)
    n = sum(p.numel() for p in model.parameters())
    return {
        "params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().cpu().clone() for k, v in model.named_buffers()},
        "losses": losses,
        "reduced_per_step": [n] * len(losses),  # not counted: a Python comm hook is not captured
        "num_params": n,
        "streams": module.schedule.num_streams if use_concur else 1,
    }


def _worker(rank: int, init_file: str, out_dir: str, cuda_graph: bool) -> None:
    torch.cuda.set_device(rank)
    torch.backends.cudnn.allow_tf32 = False  # compare orderings, not TF32 rounding
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            device_id=torch.device("cuda", rank))
    try:
        if cuda_graph:
            results = {"plain": train_graphed(rank, False), "concur": train_graphed(rank, True)}
        else:
            dev = f"cuda:{rank}"
            results = {c: train(rank, c, dev, steps=5, model_fn=make_sleepy, leaf_modules=[SleepyBackward])
                       for c in ("plain", "concur", "concur_find_unused", "concur_static_graph")}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_concur_inside_ddp_matches_plain_ddp_on_2_gpus(tmp_path, cuda_graph):
    run_workers(_worker, (str(tmp_path / "init"), str(tmp_path), cuda_graph), timeout_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    configs = list(ranks[0])
    # GPU kernels and the gradient summation order differ slightly between the plans
    check_results(ranks, configs, rtol=1e-4)

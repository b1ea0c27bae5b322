"""On the GPU: concur's one-stream captured step against PyTorch's whole-step capture (experiments/peers.py).

Counted, not timed: the CUDA kernels one replay launches (torch.profiler) and the peak memory of setup and of
the steady state, each beside the recipe's on the same model, batch, optimizer and precision.

    PYTHONPATH=. python -m pytest -q -s -m cuda tests/test_gpu_lean_step.py
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import concur
from experiments import peers
from tests.conftest import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def _resnet50_batch(batch: int = 8):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last).train()
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    return model, (x, y)


def _kernels(step, batch) -> int:
    step(*batch)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(*batch)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def _memory(build, batch) -> dict:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step = build()
    step(*batch)
    torch.cuda.synchronize()
    setup = (torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved())
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        step(*batch)
    torch.cuda.synchronize()
    steady = (torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved())
    return {"step": step, "setup": setup, "steady": steady}


def _builders(model, batch):
    loss_fn = nn.CrossEntropyLoss()
    recipe_model, concur_model = copy.deepcopy(model), copy.deepcopy(model)
    opt = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    recipe = lambda: peers.eager_graph_step(recipe_model, loss_fn, opt, batch, amp_dtype=torch.bfloat16)  # noqa: E731
    ours = lambda: concur.train_step(concur_model, loss_fn, opt(concur_model.parameters()), batch, streams=1,  # noqa: E731
                                     amp_dtype=torch.bfloat16)
    return recipe, ours


def test_one_stream_step_launches_no_more_kernels_than_the_recipe():
    model, batch = _resnet50_batch()
    recipe, ours = _builders(model, batch)
    theirs, mine = _kernels(recipe(), batch), _kernels(ours(), batch)
    print(f"\nkernels per step, ResNet-50 b8 bf16: recipe {theirs}, concur streams=1 {mine}")
    assert mine <= theirs + 2, (mine, theirs)  # (+2: the captured update's scalars, refreshed per dtype)


@pytest.mark.xfail(reason="issue 28 item 3 not met yet: on the H100 (2026-11-24) ResNet-50 b8 bf16 took 1.47x the "
                          "recipe's allocated memory in setup and 1.24x in the steady state (target 1.02x)",
                   strict=False)
def test_one_stream_step_memory_is_the_recipes():
    model, batch = _resnet50_batch()
    recipe, ours = _builders(model, batch)
    theirs = _memory(recipe, batch)
    del theirs["step"]
    mine = _memory(ours, batch)
    ratios = {k: (mine[k][0] / theirs[k][0], mine[k][1] / theirs[k][1]) for k in ("setup", "steady")}
    print(f"\nmemory, concur streams=1 / recipe (allocated, reserved): {ratios}; recipe {theirs}, concur "
          f"{ {k: mine[k] for k in ('setup', 'steady')} }")
    assert ratios["setup"][0] <= 1.02 and ratios["steady"][0] <= 1.02, ratios


def test_graphs_of_a_step_share_one_pool_and_one_warm_up_stream():
    model, (x, y) = _resnet50_batch(4)
    step = concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01), (x, y),
                             streams=1)
    step(x, y)
    step(x[:2], y[:2])  # a second shape: a second graph
    pools = {c.graph.pool() for c in step.graphs.values()}
    assert len(step.graphs) == 2 and len(pools) == 1
    assert step._runner._side is not None

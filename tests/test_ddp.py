"""A ConcurModule inside DistributedDataParallel trains exactly like plain DDP (2 gloo processes on CPU).

Both ranks train from the same initialisation on different batches: once with
plain DDP around the model, and once with DDP around ``concur.optimize(model)``,
under DDP's default settings, ``find_unused_parameters=True`` and
``static_graph=True``. Parameters, BatchNorm buffers and losses must match plain
DDP, parameters must be equal across ranks (the gradients were averaged), and a
counting communication hook must see every parameter's gradient reduced exactly
once per step. ``test_gpu_ddp.py`` runs the same workers with NCCL on 2 GPUs.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import concur
from tests.conftest import assert_close_rel
from tests.models import WideNet

WORLD = 2
STEPS = 3
BATCH = 4
CONFIGS = {  # name: (wrap with concur, DDP keyword arguments)
    "plain": (False, {}),
    "concur": (True, {}),
    "concur_find_unused": (True, {"find_unused_parameters": True}),
    "concur_static_graph": (True, {"static_graph": True}),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return WideNet(branches=4, channels=4).train()


def batch(step: int, rank: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data per rank and step, the same in every configuration."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    return x.to(device), y.to(device)


class ReductionCounter:
    """DDP communication hook state: how many gradient elements each step all-reduced."""

    def __init__(self, group: Any):
        self.group = group
        self.per_step: list[int] = [0]


def counting_allreduce(state, bucket):
    # no annotations: DDP checks them, and `from __future__ import annotations` makes them strings
    state.per_step[-1] += bucket.buffer().numel()
    return default_hooks.allreduce_hook(state.group, bucket)


def train(rank: int, config: str, device: str, steps: int = STEPS, count: bool = True,
          model_fn=make_model, leaf_modules=()) -> dict[str, Any]:
    """Train ``model_fn()`` under DDP (optionally concur inside) and return its final state."""
    use_concur, ddp_kw = CONFIGS[config]
    model = model_fn().to(device)
    module = model
    if use_concur:
        # measure=False: on a GPU the timing keeps one stream for so small a net, and the test would prove nothing
        module = concur.optimize(model, (batch(0, rank, device)[0],), streams=4, leaf_modules=leaf_modules,
                                 measure=False)
    ddp = DDP(module, device_ids=[torch.device(device).index] if device != "cpu" else None, **ddp_kw)
    counter = ReductionCounter(dist.group.WORLD)
    if count:
        ddp.register_comm_hook(counter, counting_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step, rank, device)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        counter.per_step.append(0)
    return {
        "params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().cpu().clone() for k, v in model.named_buffers()},
        "losses": losses,
        "reduced_per_step": counter.per_step[:-1],
        "num_params": sum(p.numel() for p in model.parameters()),
        "streams": module.schedule.num_streams if use_concur else 1,
    }


def _worker(rank: int, init_file: str, out_dir: str, configs: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {c: train(rank, c, "cpu") for c in configs}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_workers(fn, args: tuple, timeout_s: float = 240) -> None:
    """Spawn ``WORLD`` processes running ``fn(rank, *args)``; fail (not hang) if they do not finish."""
    ctx = mp.spawn(fn, args=args, nprocs=WORLD, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"DDP workers did not finish in {timeout_s} s (hang?)")


def check_results(ranks: list[dict], configs: list[str], rtol: float = 1e-5) -> None:
    """Every concur configuration matches plain DDP; ranks agree; each gradient reduced once per step."""
    for res in ranks:
        plain = res["plain"]
        for config in configs:
            r = res[config]
            assert r["reduced_per_step"] == [r["num_params"]] * len(r["losses"]), \
                f"{config}: gradients not all-reduced exactly once per step: {r['reduced_per_step']}"
            if config == "plain":
                continue
            assert r["streams"] > 1, f"{config}: the plan is serial, the test would prove nothing"
            names = sorted(plain["params"])
            assert_close_rel(torch.cat([r["params"][k].flatten() for k in names]),
                             torch.cat([plain["params"][k].flatten() for k in names]), rtol, f"{config} params")
            for k, b in plain["buffers"].items():
                assert_close_rel(r["buffers"][k].double(), b.double(), rtol, f"{config} buffer {k}")
            assert r["losses"] == pytest.approx(plain["losses"], rel=rtol)
    for config in configs:  # averaged gradients: both ranks end with the same parameters
        for k, v in ranks[0][config]["params"].items():
            torch.testing.assert_close(ranks[1][config]["params"][k], v, rtol=0, atol=0)


def run_workers_again_after_a_native_abort(fn, args_in: Callable[[str], tuple], tmp_path) -> None:
    """:func:`run_workers` with ``args_in(init_file)``; a worker killed by a signal (gloo has aborted a process
    from C++ under load: "terminate called without an active exception", SIGABRT) is run once more with a fresh
    rendezvous. A worker that raises, an assertion or a second abort fails the test."""
    for attempt in range(2):
        try:
            run_workers(fn, args_in(str(tmp_path / f"init{attempt}")))
            return
        except mp.ProcessExitedException as exc:
            if attempt or not exc.signal_name:
                raise
            warnings.warn(f"a DDP worker was killed by {exc.signal_name}; running the workers once more")


def _abort_in(rank: int, aborting: str, init_file: str, out_dir: str) -> None:
    if aborting in init_file:
        os.abort()
    open(os.path.join(out_dir, f"ran{rank}"), "w").close()


def test_workers_killed_by_a_signal_run_once_more_and_a_second_abort_fails(tmp_path):
    with pytest.warns(UserWarning, match="killed by SIGABRT"):
        run_workers_again_after_a_native_abort(_abort_in, lambda init: ("init0", init, str(tmp_path)), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("ran*")) == ["ran0", "ran1"]
    with pytest.raises(mp.ProcessExitedException), pytest.warns(UserWarning):
        run_workers_again_after_a_native_abort(_abort_in, lambda init: ("init", init, str(tmp_path)), tmp_path)


@pytest.mark.slow
def test_concur_inside_ddp_matches_plain_ddp(tmp_path):
    configs = list(CONFIGS)
    run_workers_again_after_a_native_abort(_worker, lambda init: (init, str(tmp_path), configs), tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    check_results(ranks, configs)
    # the ranks saw different data: without the all-reduce their parameters would differ
    assert ranks[0]["plain"]["losses"] != ranks[1]["plain"]["losses"]


def test_ddp_wraps_concur_module_parameters_without_copies():
    """DDP registers the very Parameters the optimizer and the original model hold."""
    model = make_model()
    cm = concur.optimize(model, (torch.randn(2, 3, 8, 8),), streams=4)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DDP(cm)
        assert [id(p) for p in ddp.parameters()] == [id(p) for p in model.parameters()]
        assert list(ddp.module.state_dict()) == list(model.state_dict())
        reference = copy.deepcopy(model)
        x = torch.randn(2, 3, 8, 8)
        torch.testing.assert_close(ddp(x), reference(x), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable

# Inductor compiles in a pool of worker processes, one per core, each with its own copy of torch
# (hundreds of MB): on the 2-core CI machine the suite compiles in this process instead.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import concur


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Collect only test files here: --doctest-modules (for schedulers/) would import every helper script."""
    if collection_path.suffix == ".py" and not collection_path.name.startswith(("test_", "conftest")):
        return True
    return None


# Tiers that run only when selected by name (-m TIER), each as its own CI step: the default tier
# stays within CI's budget (5 minutes, 4 GB on 2 cores) with a cold inductor cache.
OPT_IN_TIERS = ("inductor",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = config.option.markexpr or ""
    for tier in OPT_IN_TIERS:
        if tier in selected:
            continue
        skip = pytest.mark.skip(reason=f"run with -m {tier}")
        for item in items:
            if item.get_closest_marker(tier):
                item.add_marker(skip)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """Tensors of a (nested) model output in a deterministic order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in flat_tensors(value[k])]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in flat_tensors(v)]
    return []


CHUNK = 1 << 22  # elements compared at a time: float64 copies of a whole VGG gradient take 4 GB


def autograd_nodes(out: torch.Tensor, named: Callable[[str], bool]) -> int:
    """Count the nodes of the autograd graph behind ``out`` whose type name ``named`` accepts."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += named(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return count


def _squared_norms(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Return ||actual - expected||^2 and ||expected||^2, in float64, a chunk at a time."""
    diff = norm = 0.0
    for a, e in zip(actual.detach().reshape(-1).split(CHUNK), expected.detach().reshape(-1).split(CHUNK)):
        e = e.double()
        diff += (a.double() - e).square().sum().item()
        norm += e.square().sum().item()
    return diff, norm


def _check_rel(diff: float, norm: float, rtol: float, what: str) -> None:
    err = diff ** 0.5 / max(norm ** 0.5, 1e-12)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    """Assert ||actual - expected|| <= rtol * ||expected|| (float64, shapes equal)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    _check_rel(*_squared_norms(actual, expected), rtol, what)


def compare_with_original(model: torch.nn.Module, make_inputs: Callable[[], tuple], *, streams: int = 4,
                          scheduler: str = "critical_path", rtol: float = 1e-5, grad_rtol: float = 1e-4,
                          steps: int = 2,
                          device: str = "cpu", **optimize_kw) -> torch.nn.Module:
    """Run a deep copy of ``model`` and the optimized model on the same fresh inputs and seeds.

    Checks outputs and buffers to ``rtol``, all parameter gradients together to ``rtol`` and
    each one to ``grad_rtol``; outputs, parameter gradients and buffers (BatchNorm statistics, counters) after
    each of ``steps`` forward+backward passes. Returns the optimized module.
    """
    reference = copy.deepcopy(model).to(device)
    model = model.to(device)
    example = tuple(x.to(device) for x in make_inputs())
    optimized = concur.optimize(model, example, streams=streams, scheduler=scheduler, **optimize_kw)
    for step in range(steps):
        inputs = tuple(x.to(device) for x in make_inputs())
        seed = 1234 + step
        torch.manual_seed(seed)
        expected = reference(*inputs)
        torch.manual_seed(seed)
        actual = optimized(*inputs)
        exp_t, act_t = flat_tensors(expected), flat_tensors(actual)
        assert len(exp_t) == len(act_t) and type(expected) is type(actual)
        for i, (a, e) in enumerate(zip(act_t, exp_t)):
            assert_close_rel(a, e, rtol, f"step {step} output {i}")
        loss_e = sum((t.float() * torch.linspace(0.5, 1.5, t.numel(), device=t.device).view_as(t)).sum()
                     for t in exp_t if t.is_floating_point())
        loss_a = sum((t.float() * torch.linspace(0.5, 1.5, t.numel(), device=t.device).view_as(t)).sum()
                     for t in act_t if t.is_floating_point())
        reference.zero_grad(set_to_none=True)
        optimized.zero_grad(set_to_none=True)
        if isinstance(loss_e, torch.Tensor) and loss_e.requires_grad:
            loss_e.backward()
            loss_a.backward()
        ref_params = dict(reference.named_parameters())
        all_diff = all_norm = 0.0  # all gradients as one vector, without concatenating them
        any_grad = False
        for name, p in optimized.named_parameters():
            g, ge = p.grad, ref_params[name].grad
            assert (g is None) == (ge is None), f"grad presence differs for {name}"
            if g is not None:
                assert g.shape == ge.shape, f"step {step} grad {name}: shape {g.shape} != {ge.shape}"
                diff, norm = _squared_norms(g, ge)
                # Per tensor, allow fp32 reassociation: branch gradients reach a shared input in
                # the order their forward ops were issued, which the schedule changes.
                _check_rel(diff, norm, grad_rtol, f"step {step} grad {name}")
                all_diff, all_norm, any_grad = all_diff + diff, all_norm + norm, True
        if any_grad:
            _check_rel(all_diff, all_norm, rtol, f"step {step} all grads")
        ref_buffers = dict(reference.named_buffers())
        for name, b in optimized.named_buffers():
            assert_close_rel(b.float(), ref_buffers[name].float(), rtol, f"step {step} buffer {name}")
    return optimized

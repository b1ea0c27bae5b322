"""The plain loop's own envelope: how far training may drift from it when only rounding differs.

Training amplifies any difference (at lr 0.05 with momentum and small-batch BatchNorm a 1e-6
nudge reaches O(1) within a few steps), so a step-by-step tolerance measures luck. The
reference is the plain loop started from parameters nudged by ``rel``: a concurrent run may
drift from the plain loop by at most 4x as much as that twin does, and its first step must
match tightly.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


def perturbed(model: nn.Module, rel: float = 1e-6) -> nn.Module:
    """Return a copy of ``model`` whose parameters are scaled by 1 + ``rel`` * N(0, 1), seeded."""
    twin = copy.deepcopy(model)
    device = next(twin.parameters()).device
    g = torch.Generator(device=device).manual_seed(7)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1 + rel * torch.randn(p.shape, device=p.device, generator=g))
    return twin


def assert_within_envelope(label: str, losses: torch.Tensor, expected: torch.Tensor, envelope: torch.Tensor,
                           model: nn.Module, ref: nn.Module, twin: nn.Module) -> None:
    """Check losses and final parameters of a run against the plain loop (``ref``) and its nudged twin."""
    deviation = ((losses - expected).abs() / expected.abs()).cummax(0).values
    allowed = 4 * ((envelope - expected).abs() / expected.abs()).cummax(0).values + 1e-4
    print(f"{label}: max loss deviation {deviation[-1]:.2e}, envelope {allowed[-1]:.2e}")
    assert deviation[0] < 1e-5, "the first step must match"
    assert (deviation <= allowed).all(), f"deviation {deviation} exceeds envelope {allowed}"
    p = torch.cat([q.detach().flatten() for q in model.parameters()])
    pr = torch.cat([q.detach().flatten() for q in ref.parameters()])
    pt = torch.cat([q.detach().flatten() for q in twin.parameters()])
    assert (p - pr).norm() <= 4 * (pt - pr).norm() + 1e-5 * pr.norm()

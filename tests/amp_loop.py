"""PyTorch's AMP recipe as a plain training loop: the reference the mixed-precision tests compare with."""

from __future__ import annotations

import sys
from typing import Callable

import torch


def amp_recipe_loop(model: torch.nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer, batches: list,
                    dtype: torch.dtype, scaler: "torch.amp.GradScaler | None" = None) -> tuple[list[float], int]:
    """Train one step per batch under autocast (and GradScaler if given); return losses and skipped steps.

    A step counts as skipped when the scaler backs its scale off, which it
    does exactly when the step's gradients overflowed.
    """
    device = next(model.parameters()).device.type
    losses, skipped = [], 0
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        losses.append(loss.item())
    return losses, skipped


class MovedStateScaler(torch.amp.GradScaler):
    """A GradScaler of a torch that keeps its state under names concur does not know: torch's own methods
    (in ``torch.amp.grad_scaler``) still reach ``_scale`` and ``_growth_tracker``; no other code does."""

    def __getattribute__(self, name: str) -> object:
        if name in ("_scale", "_growth_tracker") and \
                sys._getframe(1).f_globals.get("__name__") != "torch.amp.grad_scaler":
            raise AttributeError(name)
        return super().__getattribute__(name)

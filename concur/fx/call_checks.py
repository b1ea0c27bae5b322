"""What a layer rewritten to record its own autograd nodes checks at each call, before it does.

A plan's rewrites (:mod:`concur.fx.weight_grads`, :mod:`concur.fx.pool_indices`)
replace a layer's call by a ``torch.autograd.Function`` of concur's. What the
plan cannot know at build time, the call checks: where any of these fails,
the layer runs as the model wrote it.
"""

from __future__ import annotations

from typing import Any

import torch

from concur import _torch_compat as compat

__all__ = ["autograd_rewrite_applies"]


def autograd_rewrite_applies(x: Any) -> bool:
    """Whether autograd records this call with ``x`` as a rewrite expects: grad mode on, ``x`` a floating tensor on
    the CPU or a CUDA device, no trace or compile underway (they record the model's own ops), and no saved-tensor
    hooks (they see what is saved: give them the plain layer's)."""
    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.is_floating_point()):
        return False
    if x.device.type not in ("cuda", "cpu") or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    return not compat.saved_tensors_hooks_active()

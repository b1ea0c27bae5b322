"""What warm-up changes, saved before it and put back after capture, in place.

Capture needs warm-up iterations (cuBLAS/cuDNN handles, autograd's lazy
buffers), and warm-up runs forward, so BatchNorm's running statistics move
and dropout draws from the generators. Those are put back, so that the first
replay is exactly the user's first step. When warm-up also runs the
optimizer (an optimizer concur does not capture itself, a ``before_step``
that may touch parameters, gradient accumulation into owned buffers), the
parameters, gradients, optimizer state and loss scale are saved too: a
full copy of the model and its optimizer, held only through setup and only
then.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from concur import _torch_compat as compat


class Snapshot:
    """Buffers and RNG state always; with ``weights``, parameters, gradients, optimizer and loss-scaler state.

    ``grads_of`` names parameters whose gradients are saved even without ``weights``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, weights: bool,
                 grad_scaler: "torch.amp.GradScaler | None" = None, grads_of: list[torch.Tensor] = ()):
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler if weights else None
        self.scaler_state = (None, None) if self.grad_scaler is None else \
            tuple(None if t is None else t.clone() for t in compat.grad_scaler_tensors(grad_scaler))
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        saved = [*model.parameters(), *model.buffers()] if weights else list(model.buffers())
        self.tensors = [(t, t.detach().clone()) for t in saved]
        self.grads = {p: (None if p.grad is None else (p.grad, p.grad.detach().clone()))
                      for p in (model.parameters() if weights else grads_of)}
        self.state = {} if not weights else {(p, k): v.detach().clone() for p, s in optimizer.state.items()
                                             for k, v in s.items() if isinstance(v, torch.Tensor)}
        self.weights = weights

    def saved_elements(self) -> int:
        """Elements copied (what the snapshot costs in memory, in elements)."""
        return sum(c.numel() for _, c in self.tensors) + sum(v.numel() for v in self.state.values()) + \
            sum(g[1].numel() for g in self.grads.values() if g is not None)

    @torch.no_grad()
    def restore(self) -> None:
        for live, saved in self.tensors:
            live.copy_(saved)
        for p, g in self.grads.items():
            if g is not None:
                g[0].copy_(g[1])
            p.grad = None if g is None else g[0]
        if self.weights:
            for p, s in self.optimizer.state.items():
                for k, v in list(s.items()):
                    if not isinstance(v, torch.Tensor):
                        continue
                    if (p, k) in self.state:
                        v.copy_(self.state[(p, k)])
                    else:  # created by warm-up: a fresh optimizer's state is zeros (Adam, SGD momentum)
                        v.zero_()
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.grad_scaler is not None:  # its tensors may first appear during warm-up
            compat.reset_grad_scaler(self.grad_scaler, *self.scaler_state)

"""What one call of a training step runs, in the order of PyTorch's recipes, eagerly or as the captured body.

A step is the plain loop's body: ``zero_grad`` at the start of an
accumulation cycle, forward and loss (under autocast with ``amp_dtype``),
``(loss / k).backward()`` (scaled by the GradScaler), and at the end of the
cycle ``before_step`` and the optimizer step (after ``unscale_`` under a
GradScaler, as the AMP recipe orders them). The eager path, warm-up and the
graph's capture all run this one body, so a replayed graph does exactly what
the plain loop would; what differs under capture is only where the
gradients live (:mod:`concur.training.gradients`) and which update is
called (:mod:`concur.training.captured_optim`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from concur.dag.annotate import tensors_in

BeforeStep = Callable[[nn.Module, torch.optim.Optimizer], Any]


@dataclass(frozen=True, eq=False)
class StepBody:
    """The work of one call of a step over ``model``; ``grad_scaler`` is None unless one is enabled."""

    model: nn.Module
    loss_fn: Callable
    optimizer: torch.optim.Optimizer
    amp_dtype: torch.dtype | None
    grad_scaler: "torch.amp.GradScaler | None"
    accumulate: int
    before_step: BeforeStep | None

    def loss(self, module: nn.Module, inputs: tuple, targets: Any) -> torch.Tensor:
        """Return the loss of forward and ``loss_fn``, under autocast when ``amp_dtype`` is set (backward runs
        outside it)."""
        with self.autocast(inputs):
            return self.loss_fn(module(*inputs), targets)

    def autocast(self, inputs: tuple) -> contextlib.AbstractContextManager:
        """The precision the step's forward runs in: autocast to ``amp_dtype`` where it is set, else nothing.

        Whatever runs the model for the step outside :meth:`loss` (the fx
        path annotating its plan and timing it) runs in it too: a plan costed
        and timed in float32 would be judged on twice the memory traffic of
        the bfloat16 step it serves.
        """
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        device = "cuda" if any(t.is_cuda for t in tensors_in(inputs)) else "cpu"
        # cache_enabled=False: autocast's weight-cast cache must not outlive a CUDA-graph capture
        return torch.autocast(device, dtype=self.amp_dtype, cache_enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss / k).backward()``, through the loss scaler when there is one."""
        if self.accumulate > 1:
            loss = loss / self.accumulate
        if self.grad_scaler is None:
            loss.backward()
        else:
            self.grad_scaler.scale(loss).backward()

    def update(self, optimizer_step: Callable[[], Any]) -> None:
        """``before_step(model, optimizer)`` then the optimizer step, as PyTorch's (AMP) recipe orders them."""
        if self.grad_scaler is None:
            if self.before_step is not None:
                self.before_step(self.model, self.optimizer)
            optimizer_step()
            return
        if self.before_step is not None:  # clipping needs true gradients: unscale first, as the AMP recipe does
            self.grad_scaler.unscale_(self.optimizer)
            self.before_step(self.model, self.optimizer)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def eager(self, inputs: tuple, targets: Any, module: nn.Module, phase: tuple[bool, bool]) -> torch.Tensor:
        """Return the loss of one call without a graph: zero_grad (first of a cycle), forward, backward, update
        (last of a cycle)."""
        first, last = phase
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(module, inputs, targets)
        self.backward(loss)
        if last:
            self.update(self.optimizer.step)
        return loss.detach()

    def micro_step(self, module: nn.Module, inputs: tuple, targets: Any, phase: tuple[bool, bool],
                   optimized: list[torch.Tensor], owned: dict[torch.Tensor, torch.Tensor] | None,
                   optimizer_step: Callable[[], Any]) -> tuple[torch.Tensor, dict]:
        """Return the loss and the gradient tensors the graph writes, running the captured body (the eager call).

        Without ``owned`` buffers the optimizer's gradients are set to None
        first, so backward writes fresh ones (under capture: in the graph's
        pool), as ``zero_grad(set_to_none=True)`` does in PyTorch's recipe.
        With them (accumulation), a cycle's first call zeroes them in place.
        """
        first, last = phase
        if owned is None:
            for p in optimized:
                p.grad = None
        elif first and owned:
            torch._foreach_zero_([owned[p] for p in optimized if p in owned])
        loss = self.loss(module, inputs, targets)
        self.backward(loss)
        if last:
            self.update(optimizer_step)
        grads = owned if owned is not None else {p: p.grad for p in optimized if p.grad is not None}
        # Keep only the value: a loss with its autograd graph would keep the AccumulateGrad
        # nodes alive, bound to this capture's stream, and a later capture would reuse them.
        return loss.detach(), dict(grads)

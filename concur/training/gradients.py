"""Which tensors hold a training step's gradients, and which of them ``p.grad`` shows after a call.

With ``accumulate=1`` backward writes fresh gradients into the graph's
memory, as in PyTorch's recipe (``zero_grad(set_to_none=True)`` before
capture): no zeroing and no add per parameter. Each graph then has its own
gradient tensors, so after a replay each ``p.grad`` is pointed at the ones
that graph wrote, as the plain loop's ``.grad`` would show them.

With accumulation the gradients live in buffers the step owns, allocated
outside the graphs, so the graphs of every cycle position and input shape add
into the same tensors. Gradients accumulated outside a graph (an eager call,
a ``zero_grad()`` between micro-batches) are carried into its buffers before
it replays.
"""

from __future__ import annotations

import torch

from concur.training.graph_runner import Captured


def optimized_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Return the parameters ``optimizer`` steps, in the order of its groups."""
    return [p for g in optimizer.param_groups for p in g["params"]]


class StepGradients:
    """The gradient buffers a step owns (with accumulation) and the graph whose gradients ``p.grad`` shows."""

    def __init__(self, optimizer: torch.optim.Optimizer, accumulate: int):
        self.optimizer, self.accumulate = optimizer, accumulate
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        self.bound: Captured | None = None  # the graph whose gradients p.grad shows now

    def own(self, reached: list[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """Return the step's own gradient buffer of each of ``reached``, each ``p.grad`` pointed at it.

        A buffer is made at the first capture that reaches its parameter, outside the graph, and kept:
        the graphs of every cycle position and input shape add into it.
        """
        owned = {p: self._buffer(p) for p in reached}
        for p, buf in owned.items():
            p.grad = buf
        return owned

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(p)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = self._buffers[p] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return buf

    def carry_into(self, captured: Captured) -> None:
        """Carry gradients accumulated outside this graph (eager calls, another cycle position) into its buffers.

        A ``zero_grad()`` between micro-batches leaves None: the graph then
        starts from zeros, as the plain loop would.
        """
        with torch.no_grad():
            for p, buf in captured.grads.items():
                g = p.grad
                if g is not buf:
                    buf.copy_(g) if g is not None else buf.zero_()

    def bind(self, captured: Captured) -> None:
        """Point each ``p.grad`` at the tensor this graph wrote, as the plain loop's ``.grad``.

        Parameters of the optimizer that this graph's backward did not reach
        show None, as after the plain loop's ``zero_grad(set_to_none=True)``.
        """
        first = next(iter(captured.grads.items()), None)
        if self.bound is captured and (first is None or first[0].grad is first[1]):
            return
        if self.accumulate == 1:
            for p in optimized_parameters(self.optimizer):
                if p not in captured.grads:
                    p.grad = None
        for p, buf in captured.grads.items():
            p.grad = buf
        self.bound = captured

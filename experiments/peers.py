"""PyTorch's own training-step recipes, written without concur: the yardstick concur is measured against.

Every speedup and memory ratio concur publishes divides a step of one of these
recipes by concur's step (``experiments/sweep``: the ``peer_*`` modes). They are
written here as the plain code a user would write from PyTorch's documentation,
importing torch and the standard library only, never concur, not even through
another module (``tests/test_peers.py`` checks), so that a bug in concur cannot
leak into the baseline it is compared with.

    eager           the plain loop: zero_grad(set_to_none=True), forward and loss under
                    autocast, backward, optimizer.step()
    compile         the same loop around torch.compile(model)
    eager_graph     the whole step in one CUDA graph: "Whole-network capture" in the CUDA
                    semantics notes (https://pytorch.org/docs/stable/notes/cuda.html#whole-network-capture)
                    and the torch.cuda.graph docs: static input and target, a warm-up of 3
                    iterations on a side stream, zero_grad(set_to_none=True), then forward,
                    loss, backward and optimizer.step() captured; each call copies the batch
                    into the static tensors and replays
    compile_graph   the same capture around torch.compile(model) (the warm-up compiles)

Each ``*_step`` function takes the same arguments, so that both sides of a ratio
share them: the model (the caller has put it and the batch in their memory
format), the loss function, the optimizer or a factory of one (torch's default
step, foreach; nothing fused), an example batch ``(x, y)``, and autocast's dtype
(None, or e.g. torch.bfloat16 for forward and loss under ``torch.autocast``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Union

import torch
import torch.nn as nn

OptimizerArg = Union[torch.optim.Optimizer, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]]
WARMUP_STEPS = 3  # the docs' whole-network capture warms up 3 iterations before capturing


@dataclass
class PeerStep:
    """One recipe's training step, built: ``step(x, y)`` trains one step and returns its loss."""

    recipe: str
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    model: nn.Module  # what runs the forward: the model, or torch.compile's wrapper of it
    optimizer: torch.optim.Optimizer
    graph: torch.cuda.CUDAGraph | None = None
    trained_steps: int = 0  # steps the recipe already took while being built (the graph recipes' warm-up)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.run(x, y)


def _optimizer(optimizer: OptimizerArg, model: nn.Module) -> torch.optim.Optimizer:
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model.parameters())


def _autocast(device_type: str, amp_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()


def _loop(recipe: str, module: nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer,
          amp_dtype: torch.dtype | None) -> PeerStep:
    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with _autocast(x.device.type, amp_dtype):
            loss = loss_fn(module(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return PeerStep(recipe, run, module, opt)


def _whole_step_graph(recipe: str, module: nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer,
                      example: tuple[torch.Tensor, torch.Tensor], amp_dtype: torch.dtype | None) -> PeerStep:
    x, y = example
    if not (torch.cuda.is_available() and x.is_cuda):
        raise RuntimeError(f"peers.{recipe}: the recipe captures the step in a CUDA graph and needs the model and "
                           f"batch on a CUDA device, but the batch is on {x.device}. On CPU use the 'eager' or "
                           "'compile' recipe.")
    static_x, static_y = x.clone(), y.clone()

    def forward_loss() -> torch.Tensor:
        with _autocast("cuda", amp_dtype):
            return loss_fn(module(static_x), static_y)

    # The docs' warm-up trains: these 3 steps update the weights, as they would in a user's run.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            opt.zero_grad(set_to_none=True)
            forward_loss().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # so that backward allocates .grad from the graph's private pool
    with torch.cuda.graph(graph):
        static_loss = forward_loss()
        static_loss.backward()
        opt.step()

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return static_loss.detach().clone()  # the next replay overwrites static_loss
    return PeerStep(recipe, run, module, opt, graph, trained_steps=WARMUP_STEPS)


def eager_step(model: nn.Module, loss_fn: Callable, optimizer: OptimizerArg,
               example: tuple[torch.Tensor, torch.Tensor] | None = None,
               amp_dtype: torch.dtype | None = None) -> PeerStep:
    """Return the plain loop's step (``example`` is not needed; accepted so that every recipe is called alike)."""
    return _loop("eager", model, loss_fn, _optimizer(optimizer, model), amp_dtype)


def compile_step(model: nn.Module, loss_fn: Callable, optimizer: OptimizerArg,
                 example: tuple[torch.Tensor, torch.Tensor] | None = None,
                 amp_dtype: torch.dtype | None = None) -> PeerStep:
    """Return the plain loop's step around ``torch.compile(model)``; its first call compiles."""
    return _loop("compile", torch.compile(model), loss_fn, _optimizer(optimizer, model), amp_dtype)


def eager_graph_step(model: nn.Module, loss_fn: Callable, optimizer: OptimizerArg,
                     example: tuple[torch.Tensor, torch.Tensor], amp_dtype: torch.dtype | None = None) -> PeerStep:
    """Return the whole-network-capture step of PyTorch's CUDA-graph docs, warmed up and captured.

    Building it trains ``WARMUP_STEPS`` steps on ``example`` (the docs' warm-up
    runs whole iterations, optimizer step included: that is what a user of the
    recipe gets). Adam and AdamW must be built with ``capturable=True`` for
    their step to be captured; the caller, as a user would, passes such an
    optimizer. Needs CUDA: on CPU it raises ``RuntimeError``.
    """
    return _whole_step_graph("eager_graph", model, loss_fn, _optimizer(optimizer, model), example, amp_dtype)


def compile_graph_step(model: nn.Module, loss_fn: Callable, optimizer: OptimizerArg,
                       example: tuple[torch.Tensor, torch.Tensor], amp_dtype: torch.dtype | None = None) -> PeerStep:
    """Return ``eager_graph_step``'s capture around ``torch.compile(model)``: the warm-up compiles, then it is captured.

    As ``eager_graph_step``: the warm-up trains, Adam/AdamW need
    ``capturable=True``, and it needs CUDA.
    """
    return _whole_step_graph("compile_graph", torch.compile(model), loss_fn, _optimizer(optimizer, model), example,
                             amp_dtype)


RECIPES: dict[str, Callable[..., PeerStep]] = {"eager": eager_step, "compile": compile_step,
                                               "eager_graph": eager_graph_step, "compile_graph": compile_graph_step}

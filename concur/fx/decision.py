"""What the fx path hands :func:`concur.dag.decide.decide` on a GPU: a timer of its two plans and a cache key.

All plans come from one trace (:func:`concur.fx.plan.generate_plan`): the
multi-stream plans (several with ``streams="auto"``) and the one-stream plan
they would fall back to. The timer
runs each as a training step would, forward and backward, captured in a CUDA
graph (:func:`concur.dag.measure.replay_rounds`), and leaves the model
as it found it: buffers, RNG, gradients, and the caller's autograd graph.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from concur.dag import decide
from concur.dag.annotate import preserved_state, tensors_in
from concur.dag.measure import environment, replay_rounds
from concur.fx.plan import Plan


def cuda_device(model: nn.Module, inputs: tuple) -> torch.device | None:
    """Return the CUDA device the inputs or the model are on, or None."""
    tensors = tensors_in(inputs) + list(model.parameters())[:1]
    return next((t.device for t in tensors if t.is_cuda), None)


def run_plan(module: nn.Module, plan: Plan, inputs: tuple) -> None:
    """Run ``plan``'s forward on ``inputs`` and, where its outputs need gradients, a backward of ones."""
    object.__setattr__(module, plan.runtime_attr, plan.runtime)
    outputs = [t for t in tensors_in(plan.forward(module, *inputs)) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


@contextlib.contextmanager
def state_kept(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Leave the model's buffers, RNG and gradients as they were: timing is no training step."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with preserved_state(model, {device}):
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def plan_timer(module: nn.Module, one_stream: Callable[[], Plan], streams: Sequence[Plan], inputs: tuple,
               device: torch.device) -> decide.Timer:
    """Return a timer of ``module``'s one-stream plan and multi-stream plans (forward, and backward where it applies).

    Inputs are detached (leaves that require gradients stay so): a plan built
    during a forward gets the caller's activations, and the timing's backward
    must end at them, not run through the caller's graph.
    """
    own = tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs)

    def timer() -> list[tuple[float, ...]]:
        plans = [one_stream(), *streams]
        with state_kept(module, device):
            return replay_rounds([functools.partial(run_plan, module, plan, own) for plan in plans], device)

    return timer


def decision_key(model: nn.Module, traced: fx.GraphModule, inputs: tuple, plans: Sequence[Plan],
                 device: torch.device) -> str:
    """Return the cache key of a measured decision: graph, modules, shapes and dtypes, precision, plan, GPU, torch.

    The traced code names the modules it calls; their settings
    (``extra_repr``), modes and parameter shapes and dtypes, the inputs'
    shapes, strides and dtypes, autocast and grad mode say what each call
    computes, so a new batch size, dtype or model finds no stale decision.
    """
    modules = tuple((name, type(m).__qualname__, m.extra_repr(), m.training) for name, m in model.named_modules())
    state = tuple((name, tuple(t.shape), str(t.dtype)) for name, t in
                  [*model.named_parameters(), *model.named_buffers()])
    shapes = tuple((tuple(t.shape), tuple(t.stride()), str(t.dtype), t.requires_grad) for t in tensors_in(inputs))
    precision = (torch.is_grad_enabled(), torch.is_autocast_enabled(device.type),
                 str(torch.get_autocast_dtype(device.type)))
    # one plan's key as it always was, so that its cached decisions stay valid
    candidates = [x for plan in plans for x in (plan.schedule.order, sorted(plan.schedule.stream.items()),
                                                plan.weight_grad_splits)]
    return decide.decision_key("fx", traced.code, modules, state, shapes, precision, *candidates,
                               environment(device), decide.MARGIN)

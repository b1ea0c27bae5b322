"""What the fx path hands :func:`concur.dag.decide.decide` on a GPU: a timer of its two plans and a cache key.

Or, where the caller times the plans itself in its own first steps
(``train_step``, :mod:`concur.training.trial`), a :class:`PendingChoice`:
the plans to time, and what settles the decision once they are timed.

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
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from concur.dag import decide
from concur.dag.annotate import preserved_state, tensors_in
from concur.dag.disk_cache import JsonCache
from concur.dag.measure import environment, replay_rounds
from concur.fx.plan import Plan

__all__ = ["plan_timer", "decision_key", "PendingChoice"]


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
                 device: torch.device, *timed_as: str) -> str:
    """Return the cache key of a measured decision: graph, modules, shapes and dtypes, precision, plan, GPU, torch.

    The traced code names the modules it calls; their settings
    (``extra_repr``), modes and parameter shapes and dtypes, the inputs'
    shapes, strides and dtypes, autocast and grad mode say what each call
    computes, so a new batch size, dtype or model finds no stale decision.
    ``timed_as`` names another way of timing the plans (whole training
    steps), whose decisions are kept apart.
    """
    modules = tuple((name, type(m).__qualname__, m.extra_repr(), m.training) for name, m in model.named_modules())
    state = tuple((name, tuple(t.shape), str(t.dtype)) for name, t in
                  [*model.named_parameters(), *model.named_buffers()])
    shapes = tuple((tuple(t.shape), tuple(t.stride()), str(t.dtype), t.requires_grad) for t in tensors_in(inputs))
    precision = (torch.is_grad_enabled(), torch.is_autocast_enabled(device.type),
                 str(torch.get_autocast_dtype(device.type)))
    # one plan's key as it always was, so that its cached decisions stay valid; a plan whose pools save no
    # indices runs other kernels in backward, so its decisions are its own
    candidates = [x for plan in plans for x in (plan.schedule.order, sorted(plan.schedule.stream.items()),
                                                plan.weight_grad_splits,
                                                *([("pool_recomputes", plan.pool_recomputes)]
                                                  if plan.pool_recomputes else []))]
    return decide.decision_key("fx", traced.code, modules, state, shapes, precision, *candidates,
                               environment(device), decide.MARGIN, *timed_as)


@dataclass
class PendingChoice:
    """A decision :func:`concur.dag.decide.choose` makes once the caller has timed the plans.

    ``programs`` are the plans to time, one stream first, in the order of
    each timed round's times; ``plans[i]`` is the plan of ``predictions[i]``.
    Until it is settled the module runs ``plans[default]``, the candidate
    the prediction picks.
    """

    what: str
    predictions: list[decide.Prediction]
    plans: list[Plan]
    timed: list[int]  # indices of the candidates timed, in the order of their times in a round
    one_stream: Plan
    key: str | None  # where the decision is cached once timed; None: not cached
    default: int

    def predicted_alone(self, why: str, cached: bool) -> "PendingChoice":
        """The choice between one stream and the predicted candidate alone: where the programs are timed one
        at a time (:class:`concur.training.trial.OneAtATime`; ``why``, said in the decision's line).

        Cached under :attr:`key` only where ``cached`` and the predicted
        candidate is the only one: the cache holds a decision between every
        candidate, and a choice narrowed from several is not that decision.
        """
        return replace(self, what=f"{self.what} (timed one at a time, {why})",
                       predictions=[self.predictions[self.default]], plans=[self.plans[self.default]],
                       timed=[0], key=self.key if cached and len(self.plans) == 1 else None, default=0)

    @property
    def programs(self) -> list[Plan]:
        """The plans a round times: one stream, then each timed candidate."""
        return [self.one_stream, *(self.plans[i] for i in self.timed)]

    def program_of_default(self) -> int:
        """Return the index in :attr:`programs` of the plan the module runs until the choice is settled."""
        return 1 + self.timed.index(self.default)

    def settle(self, rounds: Sequence[tuple[float, ...]] | None, why: str = "") -> tuple[decide.Decision, Plan]:
        """Return the decision the timed ``rounds`` give (cached under :attr:`key`), and the plan it runs.

        Without rounds (the caller could not capture the programs to time
        them; ``why``: the exception) the prediction decides, not cached: a
        later run times again.
        """
        def untimed() -> list:
            raise RuntimeError(f"capturing the programs to time them failed ({why})")

        timed = rounds is not None
        decision = decide.choose(f"{self.what}, {'timed ' if timed else ''}on the step's first calls",
                                 self.predictions, timer=(lambda: rounds) if timed else untimed,
                                 cache=JsonCache() if timed and self.key else None,
                                 key=self.key if timed else None,
                                 scope="step")
        return decision, self.plans[decision.candidate] if decision.keep else self.one_stream

"""SGD, Adam and AdamW updates that read their hyperparameters from device tensors, for captured steps.

A CUDA graph records each kernel's arguments by value. torch's optimizers
hand ``lr``, ``momentum`` and ``betas`` to their kernels as Python floats, so
a graph captured once keeps the values of its capture: every
``torch.optim.lr_scheduler`` step after it would be silently lost, and
``OneCycleLR``/``CyclicLR``, which also rewrite SGD's momentum and Adam's
beta1, doubly so. torch's own tensor-``lr`` support does not cover SGD's
momentum (a float in every implementation) and differs between versions.

So the captured step runs the same update here, written with ``torch._foreach``
ops whose scalars are 0-dim tensors on the parameters' device. Before each
replay :meth:`DeviceHyperparameters.refresh` writes the param groups' current
values into those tensors (one fill kernel per value that changed, no host
sync). The user's optimizer is left as it is: its groups keep plain floats
for the schedulers, and its ``state`` holds the tensors the update writes
(``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``), so
``state_dict()``, checkpoints and eager ``optimizer.step()`` calls carry on
from where the graph left off.

Only the exact classes ``torch.optim.SGD``, ``Adam`` and ``AdamW`` are
handled (a subclass may change ``step``); :func:`unsupported_reason` says
why another optimizer is not, and the caller then keys its graphs on the
hyperparameter values instead (a new value is a new capture).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# eps stays a float in the captured code (no scheduler moves it; a new value is a new capture): adding a
# device scalar to a list of tensors would need torch's _foreach_add Tensor overload, newer than the others used.
_NAMES = {torch.optim.SGD: ("lr", "momentum", "weight_decay"),
          torch.optim.Adam: ("lr", "beta1", "beta2", "weight_decay"),
          torch.optim.AdamW: ("lr", "beta1", "beta2", "weight_decay")}


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Return why the device-tensor update cannot stand in for ``optimizer.step()``, or None if it can."""
    cls = type(optimizer)
    if cls not in SUPPORTED:
        return f"{cls.__name__} is not one of SGD, Adam, AdamW"
    step = optimizer.__dict__.get("step")
    if step is not None and not any(hasattr(step, a) for a in ("_wrapped_by_lr_sched", "_with_counter")):
        # (lr schedulers wrap it to note that it was called)
        return f"{cls.__name__}.step was replaced on the instance"
    if _has_step_hooks(optimizer):
        return f"{cls.__name__} has step hooks, which only optimizer.step() runs"
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return "a param group has differentiable=True"
    return None


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_module

    own = (getattr(optimizer, "_optimizer_step_pre_hooks", None), getattr(optimizer, "_optimizer_step_post_hooks", None))
    shared = (getattr(optim_module, "_global_optimizer_pre_hooks", None),
              getattr(optim_module, "_global_optimizer_post_hooks", None))
    if any(h is None for h in own + shared):  # a torch that keeps them elsewhere: assume there are hooks
        return True
    return any(len(h) for h in own + shared)


def _value(group: dict, name: str) -> float | torch.Tensor:
    if name == "beta1":
        return group["betas"][0]
    if name == "beta2":
        return group["betas"][1]
    return group[name]


def structure(optimizer: torch.optim.Optimizer) -> tuple:
    """Return what the captured update's code depends on besides the values of its hyperparameters.

    A change here (nesterov switched on, weight decay from 0 to non-zero, a
    new group) needs a new capture; a change of a value only needs a refresh.
    """
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    out = []
    for g in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD):
            out.append((bool(g["nesterov"]), bool(g.get("maximize", False)), _nonzero(g["momentum"]),
                        _nonzero(g["weight_decay"]), float(g.get("dampening", 0))))
        else:
            out.append((bool(g["amsgrad"]), bool(g.get("maximize", False)), _nonzero(g["weight_decay"]),
                        decoupled or bool(g.get("decoupled_weight_decay", False)), float(g["eps"])))
    return tuple(out)


def _nonzero(x: float | torch.Tensor) -> bool:
    return bool(x != 0) if not isinstance(x, torch.Tensor) else True  # a tensor value may change: keep its code


class DeviceHyperparameters:
    """One float64 0-dim tensor per hyperparameter of each param group, on the group's device."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.names = _NAMES[type(optimizer)]
        self.tensors: list[dict[str, torch.Tensor]] = []
        self.seen: list[dict[str, object]] = []
        self.sync_groups()

    def sync_groups(self) -> None:
        """Make one set of tensors per param group (after groups were added), then refresh all."""
        for group in self.optimizer.param_groups[len(self.tensors):]:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            self.tensors.append({n: torch.zeros((), dtype=torch.float64, device=device) for n in self.names})
            self.seen.append({})
        self.refresh()

    def refresh(self) -> None:
        """Write every hyperparameter that changed since the last refresh into its tensor (no host sync)."""
        for group, tensors, seen in zip(self.optimizer.param_groups, self.tensors, self.seen):
            for name in self.names:
                value = _value(group, name)
                if isinstance(value, torch.Tensor):
                    tensors[name].copy_(value.detach().reshape(()), non_blocking=True)
                elif seen.get(name) != value:
                    tensors[name].fill_(value)
                    seen[name] = value


@dataclass
class _Bucket:
    """Parameters of one group on one device and dtype, updated together by ``torch._foreach`` ops."""

    group: int
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: dict[str, list[torch.Tensor]]


def build_update(optimizer: torch.optim.Optimizer, hyper: DeviceHyperparameters,
                 grads: dict[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    """Return ``update()``: one optimizer step over the parameters in ``grads``, reading ``hyper``.

    ``grads`` maps each parameter that receives a gradient to the tensor the
    step accumulates it in; parameters without one are skipped, as
    ``optimizer.step()`` skips those whose ``.grad`` is None. Missing
    optimizer state is created here, as zeros (what a first step starts from).
    Everything the update touches is fixed now: it is captured once and
    replayed.
    """
    is_sgd = isinstance(optimizer, torch.optim.SGD)
    buckets = _buckets(optimizer, grads, is_sgd)
    flags = structure(optimizer)
    if is_sgd:
        steps = [_sgd_bucket(b, hyper.tensors[b.group], *flags[b.group][:4]) for b in buckets]
    else:
        steps = [_adam_bucket(b, hyper.tensors[b.group], *flags[b.group]) for b in buckets]

    @torch.no_grad()
    def update() -> None:
        for step in steps:
            step()

    return update


def _buckets(optimizer: torch.optim.Optimizer, grads: dict, is_sgd: bool) -> list[_Bucket]:
    buckets: dict[tuple, _Bucket] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in grads:
                continue
            state = optimizer.state[p]
            if is_sgd:
                if _nonzero(group["momentum"]) and state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                names = ["momentum_buffer"] if _nonzero(group["momentum"]) else []
            else:
                _init_adam_state(state, p, group["amsgrad"])
                names = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
            key = (gi, p.device, p.dtype)
            if key not in buckets:
                buckets[key] = _Bucket(gi, [], [], {n: [] for n in names})
            b = buckets[key]
            b.params.append(p)
            b.grads.append(grads[p])
            for n in names:
                b.state[n].append(state[n])
    return list(buckets.values())


def _init_adam_state(state: dict, p: torch.Tensor, amsgrad: bool) -> None:
    """Adam's state as its first step makes it, but with ``step`` on the parameter's device (the graph adds to it)."""
    if "step" not in state:
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["step"] = torch.zeros((), dtype=dtype, device=p.device)
    elif state["step"].device != p.device:
        state["step"] = state["step"].to(p.device)
    for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
        if name not in state:
            state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sgd_bucket(b: _Bucket, h: dict[str, torch.Tensor], nesterov: bool, maximize: bool, momentum_on: bool,
                decay_on: bool) -> Callable[[], None]:
    """torch.optim.SGD's update (dampening 0): d = g + wd*p; buf = m*buf + d; p -= lr*(d + m*buf if nesterov else buf)."""
    device, dtype = b.params[0].device, b.params[0].dtype

    def step() -> None:
        lr, m, wd = (h[n].to(device=device, dtype=dtype) for n in ("lr", "momentum", "weight_decay"))
        d = torch._foreach_neg(b.grads) if maximize else b.grads
        if decay_on:
            d = torch._foreach_add(d, torch._foreach_mul(b.params, wd))
        if momentum_on:
            bufs = b.state["momentum_buffer"]
            torch._foreach_mul_(bufs, m)
            torch._foreach_add_(bufs, d)
            d = torch._foreach_add(d, torch._foreach_mul(bufs, m)) if nesterov else bufs
        torch._foreach_add_(b.params, torch._foreach_mul(d, -lr))

    return step


def _adam_bucket(b: _Bucket, h: dict[str, torch.Tensor], amsgrad: bool, maximize: bool, decay_on: bool,
                 decoupled: bool, eps: float) -> Callable[[], None]:
    """torch.optim.Adam's update (AdamW's with ``decoupled``), bias corrections in float64 on the device.

    The per-parameter scalars (bias corrections of each step count) are
    lists of 0-dim tensors, as in torch's own capturable Adam.
    """
    device, dtype = b.params[0].device, b.params[0].dtype
    steps, avgs, sqs = b.state["step"], b.state["exp_avg"], b.state["exp_avg_sq"]

    def step() -> None:
        lr, beta1, beta2, wd = (h[n].to(device) for n in ("lr", "beta1", "beta2", "weight_decay"))
        cast = lambda t: t.to(dtype)  # noqa: E731
        torch._foreach_add_(steps, 1)
        g = torch._foreach_neg(b.grads) if maximize else b.grads
        if decay_on:
            if decoupled:
                torch._foreach_mul_(b.params, cast(1 - lr * wd))
            else:
                g = torch._foreach_add(g, torch._foreach_mul(b.params, cast(wd)))
        torch._foreach_mul_(avgs, cast(beta1))
        torch._foreach_add_(avgs, torch._foreach_mul(g, cast(1 - beta1)))
        torch._foreach_mul_(sqs, cast(beta2))
        torch._foreach_add_(sqs, torch._foreach_mul(torch._foreach_mul(g, g), cast(1 - beta2)))
        # Each parameter's own step count: a parameter frozen for a while has taken fewer steps.
        t = torch.stack(steps).to(torch.float64)
        bias1, bias2 = 1 - beta1.pow(t), 1 - beta2.pow(t)
        if amsgrad:
            torch._foreach_maximum_(b.state["max_exp_avg_sq"], sqs)
            denom = torch._foreach_sqrt(b.state["max_exp_avg_sq"])
        else:
            denom = torch._foreach_sqrt(sqs)
        torch._foreach_div_(denom, list(cast(bias2.sqrt()).unbind()))
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(avgs, denom)
        torch._foreach_mul_(update, list(cast(-lr / bias1).unbind()))
        torch._foreach_add_(b.params, update)

    return step

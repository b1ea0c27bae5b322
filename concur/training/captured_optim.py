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

Why not torch's own step with tensor hyperparameters: on torch 2.13, 2.14
and 2.15 (read in their ``torch/optim/adam.py``; the code came with torch
2.6, so 2.11 has it too) ``_multi_tensor_adam`` takes ``lr``, ``beta1`` and
``beta2`` as tensors, but only with ``capturable=True``, which refuses CPU
parameters; ``weight_decay`` and ``eps`` stay floats; and the tensor
``beta1`` reaches ``_foreach_lerp_`` as a number, read with ``.item()``,
which a CUDA graph cannot capture. ``_fused_adam_`` and ``_fused_sgd_`` take
a tensor ``lr`` only, with float betas and momentum. So the updates are
written here, each in no more multi-tensor ops and temporaries than torch's
foreach ``step()`` (see ``tests/test_captured_optim.py``), except Adam's
L2 weight decay, one op more (below).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch

from concur import _torch_compat as compat

__all__ = ["SUPPORTED", "unsupported_reason", "structure", "GroupsWatch", "DeviceHyperparameters", "build_update",
           "scale_dtype"]


SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# eps and a float beta2 stay floats in the captured code (no torch scheduler moves them; a new value is a new
# capture): torch's _foreach_addcmul_ takes its factor as a host number only, so a device beta2 would cost the
# second moment a third op (see _adam_bucket), and a device eps gains nothing.


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Return why the device-tensor update cannot stand in for ``optimizer.step()``, or None if it can."""
    cls = type(optimizer)
    if cls not in SUPPORTED:
        return f"{cls.__name__} is not one of SGD, Adam, AdamW"
    if compat.step_replaced_on_instance(optimizer):  # (an lr scheduler's wrapper does not count)
        return f"{cls.__name__}.step was replaced on the instance"
    if compat.optimizer_has_step_hooks(optimizer):
        return f"{cls.__name__} has step hooks, which only optimizer.step() runs"
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return "a param group has differentiable=True"
    return None


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
            beta2 = g["betas"][1]  # a tensor is read where it lives; its value may change
            out.append((bool(g["amsgrad"]), bool(g.get("maximize", False)), _nonzero(g["weight_decay"]),
                        decoupled or bool(g.get("decoupled_weight_decay", False)), float(g["eps"]),
                        "tensor" if isinstance(beta2, torch.Tensor) else float(beta2)))
    return tuple(out)


# Values a param group holds that stay what they are while the group holds the same object (a float's value is
# fixed, a numpy float64's too: it is a float)
_IMMUTABLE = (float, int, str, type(None))


def _immutable(value: object) -> bool:
    return isinstance(value, _IMMUTABLE) or (type(value) is tuple and all(isinstance(v, _IMMUTABLE) for v in value))


class GroupsWatch:
    """Whether an optimizer's param groups still hold the very hyperparameter objects they held at the last look.

    A call before each replay that finds them unchanged can skip what is a
    function of their values alone (the hyperparameter key, the refresh of
    the device tensors): the same object is the same value, as long as no
    value can change in place. A tensor or a list can, so a group holding one
    is never found unchanged; neither is the first look, nor a group added or
    replaced (``load_state_dict``) whose values are other objects. The
    ``params`` lists are not watched (the graph key has their ids and lengths).
    Each reader keeps a watch of its own: a look moves the watch on.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._last: list[tuple[tuple, tuple]] | None = None
        self._immutable = False  # whether the values of the last look are all immutable

    def unchanged(self) -> bool:
        """Look at the groups now: True if every group holds what it held at the last look, all immutable."""
        groups = self.optimizer.param_groups
        now = [(tuple(g), tuple(g.values())) for g in groups]
        last, self._last = self._last, now
        if last is not None and len(last) == len(now) and all(
                keys == last_keys and all(map(operator.is_, values, last_values))
                for (keys, values), (last_keys, last_values) in zip(now, last)):
            return self._immutable  # the same objects: as immutable as they were
        self._immutable = all(_immutable(v) for g in groups for k, v in g.items() if k != "params")
        return False


def _nonzero(x: float | torch.Tensor) -> bool:
    return bool(x != 0) if not isinstance(x, torch.Tensor) else True  # a tensor value may change: keep its code


# Scalars the captured updates read, each a function of a param group's values. They are worked out on the host
# at refresh (one fill kernel per changed value, outside the graph), so the graph computes no scalar itself but
# Adam's bias corrections, which need the step counts on the device. A tuple is held as a column, one row a value.
_DERIVED: dict[str, Callable[[dict], float | torch.Tensor | tuple]] = {
    "lr": lambda g: g["lr"],
    "momentum": lambda g: g["momentum"],
    "weight_decay": lambda g: g["weight_decay"],
    "lr_momentum": lambda g: g["lr"] * g["momentum"],
    "one_minus_lr_wd": lambda g: 1 - g["lr"] * g["weight_decay"],
    "one_minus_beta1": lambda g: 1 - g["betas"][0],
    "one_minus_beta2": lambda g: 1 - g["betas"][1],
    "beta2_over_one_minus_beta2": lambda g: g["betas"][1] / (1 - g["betas"][1]),
    "betas": lambda g: (g["betas"][0], g["betas"][1]),
    "eps_neg_lr": lambda g: (g["eps"], -g["lr"]),
}


def scale_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a scalar that :func:`concur._torch_compat.foreach_axpy_` reads (float32 on CUDA)."""
    return torch.float32 if device.type == "cuda" and dtype != torch.float64 else dtype


class DeviceHyperparameters:
    """0-dim device tensors holding each param group's hyperparameters, made on demand per dtype and device.

    The captured update asks :meth:`scalar` for what it reads while it is
    built (outside any graph); :meth:`refresh` writes the groups' current
    values into them before each replay.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.tensors: dict[tuple[int, str, torch.dtype, torch.device], torch.Tensor] = {}
        self.seen: dict[tuple, object] = {}
        self._groups = GroupsWatch(optimizer)

    def scalar(self, group: int, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return the tensor holding ``name`` (a key of ``_DERIVED``) of param group ``group``, filled now.

        0-dim, or of shape ``(k, 1)`` where ``name`` gives a tuple of ``k`` values.
        """
        key = (group, name, dtype, torch.device(device))
        if key not in self.tensors:
            value = _DERIVED[name](self.optimizer.param_groups[group])
            shape = (len(value), 1) if isinstance(value, tuple) else ()
            self.tensors[key] = torch.zeros(shape, dtype=dtype, device=device)
            self._write(key)
        return self.tensors[key]

    def refresh(self) -> None:
        """Write every hyperparameter that changed since the last refresh into its tensors (no host sync).

        A tensor made since (:meth:`scalar`) was filled when it was made, so
        where the groups hold the same values as at the last refresh
        (:class:`GroupsWatch`) nothing is read: this runs before every replay.
        """
        if self._groups.unchanged():
            return
        for key in self.tensors:
            self._write(key)

    def _write(self, key: tuple) -> None:
        group, name = key[0], key[1]
        value = _DERIVED[name](self.optimizer.param_groups[group])
        if not isinstance(value, tuple):
            self._fill(key, lambda: self.tensors[key], value)
            return
        for row, v in enumerate(value):
            self._fill(key + (row,), lambda: self.tensors[key][row, 0], v)

    def _fill(self, seen_key: tuple, target: Callable[[], torch.Tensor], value: float | torch.Tensor) -> None:
        if isinstance(value, torch.Tensor):
            target().copy_(value.detach().reshape(()), non_blocking=True)
        elif self.seen.get(seen_key) != value:
            target().fill_(value)
            self.seen[seen_key] = value


@dataclass
class _Bucket:
    """Parameters of one group on one device and dtype, updated together by ``torch._foreach`` ops."""

    group: int
    params: list[torch.Tensor]
    state: dict[str, list[torch.Tensor]]

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def grads(self) -> list[torch.Tensor]:
        """The gradients as they are now: the captured step reads them while it is captured."""
        return [p.grad for p in self.params]

    def shadow(self) -> tuple["_Bucket", list[torch.Tensor]]:
        """A one-element stand-in of this bucket and its gradients, to warm the update's kernels up on.

        The update then runs once before capture (the same kernels, lazily
        loaded ones included) without touching the user's parameters or state.
        """
        one = lambda t: torch.zeros((1,) * max(t.dim(), 1), dtype=t.dtype, device=t.device)  # noqa: E731
        state = {n: [torch.zeros_like(ts[0]) if ts[0].dim() == 0 else one(ts[0])] for n, ts in self.state.items()}
        return _Bucket(self.group, [one(self.params[0])], state), [one(self.params[0])]


def build_update(optimizer: torch.optim.Optimizer, hyper: DeviceHyperparameters,
                 params: list[torch.Tensor]) -> Callable[[], None]:
    """Return ``update()``: one optimizer step over ``params``, reading ``hyper`` and each ``p.grad``.

    ``params`` are the parameters that receive a gradient; the others are
    skipped, as ``optimizer.step()`` skips those whose ``.grad`` is None.
    The gradients are read when ``update()`` runs: under capture these are
    the tensors backward has just written. Missing optimizer state is created
    here, as zeros (what a first step starts from). ``update.warm_up()`` runs
    the same kernels on one-element stand-ins.
    """
    is_sgd = isinstance(optimizer, torch.optim.SGD)
    buckets = _buckets(optimizer, set(params), is_sgd)
    flags = structure(optimizer)
    make = (lambda b: _sgd_bucket(b, hyper, *flags[b.group][:4])) if is_sgd else \
        (lambda b: _adam_bucket(b, hyper, *flags[b.group][:4], beta2=flags[b.group][5]))  # eps: on the device
    steps = [(make(b), b) for b in buckets]

    @torch.no_grad()
    def update() -> None:
        for step, bucket in steps:
            step(bucket, bucket.grads())

    @torch.no_grad()
    def warm_up() -> None:
        for step, bucket in steps:
            step(*bucket.shadow())

    update.warm_up = warm_up  # type: ignore[attr-defined]
    return update


def _buckets(optimizer: torch.optim.Optimizer, params: set, is_sgd: bool) -> list[_Bucket]:
    buckets: dict[tuple, _Bucket] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in params:
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
                buckets[key] = _Bucket(gi, [], {n: [] for n in names})
            b = buckets[key]
            b.params.append(p)
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


def _sgd_bucket(b: _Bucket, hyper: DeviceHyperparameters, nesterov: bool, maximize: bool, momentum_on: bool,
                decay_on: bool) -> Callable[[_Bucket, list[torch.Tensor]], None]:
    """torch.optim.SGD's update (dampening 0) with no temporary and as many multi-tensor kernels as torch's.

    torch's foreach step: ``d = g + wd*p`` (a temporary), ``buf = m*buf + d``,
    ``p -= lr*(d + m*buf if nesterov else buf)``. Here every ``x += s*y`` with
    a device scalar ``s`` is one fused kernel (:func:`compat.foreach_axpy_`),
    and weight decay goes into the buffer (``buf += wd*p``) or scales the
    parameters (``p *= 1 - lr*wd``), so no gradient-sized temporary is made.
    Rounding differs from torch's order by an ulp, as any reordering would.
    """
    scalar = lambda name, dtype: hyper.scalar(b.group, name, dtype, b.device)  # noqa: E731
    sdt = scale_dtype(b.device, b.dtype)
    lr, m = scalar("lr", sdt), scalar("momentum", b.dtype)
    wd, lr_m, shrink = scalar("weight_decay", sdt), scalar("lr_momentum", sdt), scalar("one_minus_lr_wd", b.dtype)
    descend = maximize  # maximize: p += lr*d, and d = -g + wd*p

    def step(bucket: _Bucket, grads: list[torch.Tensor]) -> None:
        params = bucket.params
        if not momentum_on:
            if decay_on:
                torch._foreach_mul_(params, shrink)
            compat.foreach_axpy_(params, grads, lr, add=descend)
            return
        bufs = bucket.state["momentum_buffer"]
        torch._foreach_mul_(bufs, m)
        (torch._foreach_sub_ if maximize else torch._foreach_add_)(bufs, grads)
        if decay_on:
            compat.foreach_axpy_(bufs, params, wd, add=True)
        if nesterov:  # p -= lr*(d + m*buf) with d = ±g + wd*p, each term in turn
            if decay_on:
                torch._foreach_mul_(params, shrink)
            compat.foreach_axpy_(params, grads, lr, add=descend)
            compat.foreach_axpy_(params, bufs, lr_m, add=False)
        else:
            compat.foreach_axpy_(params, bufs, lr, add=False)

    return step


def _adam_bucket(b: _Bucket, hyper: DeviceHyperparameters, amsgrad: bool, maximize: bool, decay_on: bool,
                 decoupled: bool, beta2: float | str) -> Callable[[_Bucket, list[torch.Tensor]], None]:
    """torch.optim.Adam's update (AdamW's with ``decoupled``) in the multi-tensor ops of torch's foreach step.

    torch's foreach ``step()``, op for op, against this one (``g`` the gradient):

    ==================  =====================================  ======================================
    moment / term       torch (host numbers)                   here (device tensors)
    ==================  =====================================  ======================================
    first moment ``m``  ``lerp_(m, g, 1-beta1)``                the same lerp, as one fused op
                                                               (:func:`compat.foreach_lerp_`; three
                                                               and a temporary for CUDA float64)
    second ``v``        ``v *= beta2``; ``v += (1-beta2) g g``  the same (beta2 is a float: structure)
    denominator         ``d = sqrt(v)`` (a temporary);          ``d = sqrt(v)``; ``d += eps*c2``;
                        ``d /= c2``; ``d += eps``               ``d *= c1 / (-lr*c2)``
    update              ``p += (-lr/c1) * m / d``               ``p += m / d``
    ==================  =====================================  ======================================

    with ``c1 = 1 - beta1**t`` and ``c2 = sqrt(1 - beta2**t)`` for each
    parameter's own step count ``t`` (a parameter frozen for a while has
    taken fewer steps). torch reads ``t`` on the host; here they are stacked
    into one vector on the device and both per-parameter scalars come out of
    a few kernels over it, in float64 as torch's host arithmetic is. The
    rearranged denominator is the same number up to rounding (and, like
    torch's, a zero ``lr`` leaves the parameters as they are). On CUDA an op
    of a list of parameters with a list of 0-dim tensors runs one kernel per
    parameter, as torch's own capturable Adam does for its two such ops.

    ``maximize`` needs no negated copy of the gradient: ``g*g`` does not
    see its sign and the lerp takes ``-g``. Adam's L2 decay makes
    ``g + wd*p`` as torch does (its one other temporary), but in two ops
    where torch takes one: torch adds ``wd*p`` with ``wd`` as a host number.
    A tensor ``beta2`` is read on the device at the cost of a third op on
    ``v``: ``v *= beta2/(1-beta2)``; ``v += g*g``; ``v *= 1-beta2``.
    """
    scalar = lambda name, dtype: hyper.scalar(b.group, name, dtype, b.device)  # noqa: E731
    f64, dt = torch.float64, b.dtype
    weight1 = scalar("one_minus_beta1", scale_dtype(b.device, dt))
    wd, shrink = scalar("weight_decay", dt), scalar("one_minus_lr_wd", dt)
    betas, eps_neg_lr = scalar("betas", f64), scalar("eps_neg_lr", f64)  # columns (beta1, beta2), (eps, -lr)
    if beta2 == "tensor":
        ratio2, weight2 = scalar("beta2_over_one_minus_beta2", dt), scalar("one_minus_beta2", dt)

    def step(bucket: _Bucket, grads: list[torch.Tensor]) -> None:
        params, steps = bucket.params, bucket.state["step"]
        avgs, sqs = bucket.state["exp_avg"], bucket.state["exp_avg_sq"]
        torch._foreach_add_(steps, 1)
        g, negate = grads, maximize
        if decay_on and decoupled:
            torch._foreach_mul_(params, shrink)
        elif decay_on:  # g = wd*p ± grad, a temporary as in torch's step
            g = torch._foreach_mul(params, wd)
            (torch._foreach_sub_ if maximize else torch._foreach_add_)(g, grads)
            negate = False
        compat.foreach_lerp_(avgs, g, weight1, negate=negate)
        if beta2 == "tensor":
            torch._foreach_mul_(sqs, ratio2)
            torch._foreach_addcmul_(sqs, g, g)
            torch._foreach_mul_(sqs, weight2)
        else:
            torch._foreach_mul_(sqs, beta2)
            torch._foreach_addcmul_(sqs, g, g, 1 - beta2)
        del g  # free the decayed gradient before the denominator's temporary, as torch does
        eps_hat, scale = _bias_corrections(steps, betas, eps_neg_lr, dt)
        if amsgrad:
            torch._foreach_maximum_(bucket.state["max_exp_avg_sq"], sqs)
            sqs = bucket.state["max_exp_avg_sq"]
        denom = torch._foreach_sqrt(sqs)
        torch._foreach_add_(denom, eps_hat)
        torch._foreach_mul_(denom, scale)
        torch._foreach_addcdiv_(params, avgs, denom)

    return step


def _bias_corrections(steps: list[torch.Tensor], betas: torch.Tensor, eps_neg_lr: torch.Tensor,
                      dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Return ``eps*c2`` and ``c1/(-lr*c2)`` of each step count, as lists of 0-dim tensors of ``dtype``.

    Eight small kernels whatever the number of parameters (a cast fewer
    where the step counts, or the parameters, are float64): stack, cast,
    ``betas**t``, ``1 - .``, ``sqrt``, one product for both rows, one
    quotient, cast.
    """
    t = torch.stack(steps).to(torch.float64)
    c = 1 - betas.pow(t)  # rows: 1 - beta1**t, 1 - beta2**t
    terms = eps_neg_lr * c[1].sqrt()  # rows: eps*c2, -lr*c2
    torch.div(c[0], terms[1], out=terms[1])
    eps_hat, scale = terms.to(dtype).unbind()
    return list(eps_hat.unbind()), list(scale.unbind())

"""What a captured step depends on besides its input shapes, read on every call.

A replay reruns the kernels of its capture, so everything the trace read
from Python is frozen in it: the train/eval flag of every module, the
``requires_grad`` of every parameter, the module tree, the parameters'
storages, the param groups and ``optimizer.load_state_dict`` calls. These
are fingerprinted on every call and form part of the graph's key, so a
change gives a new capture, never a replay of a stale graph.

The module tree is walked again only after a registration somewhere:
torch's global registration hooks count them (walking a 240-module model
costs ~0.6 ms, reading its flags from a kept list ~0.05 ms). Those hooks are
process-wide, so they are registered while at least one step watches and
removed when the last one is gone.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Any

import torch
import torch.nn as nn

from concur.training import captured_optim


class _Registrations:
    """A count of module, parameter and buffer registrations, kept while any :class:`ModelFingerprint` lives."""

    def __init__(self) -> None:
        self.count = 0
        self._watchers = 0
        self._handles: list = []
        self._lock = threading.Lock()

    def _seen(self, *args: Any) -> None:
        self.count += 1

    def watch(self) -> None:
        from torch.nn.modules import module as module_mod

        with self._lock:
            self._watchers += 1
            if self._watchers == 1:
                self._handles = [getattr(module_mod, name)(self._seen) for name in (
                    "register_module_module_registration_hook", "register_module_parameter_registration_hook",
                    "register_module_buffer_registration_hook")]

    def unwatch(self) -> None:
        with self._lock:
            self._watchers -= 1
            if self._watchers == 0:
                for handle in self._handles:
                    handle.remove()
                self._handles = []

    @property
    def hooked(self) -> bool:
        return bool(self._handles)


REGISTRATIONS = _Registrations()
_TRAINING = operator.attrgetter("training")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _hashable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))  # read by the kernels where it lives, not baked as a float
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


class ModelFingerprint:
    """The model's tree, flags and storages and the optimizer's groups, as a key (~50 us at 240 modules)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        REGISTRATIONS.watch()
        weakref.finalize(self, REGISTRATIONS.unwatch)
        self._registrations = REGISTRATIONS.count
        self.tree = self._walk()
        self.tree_version = 0
        self.loads = [0]  # optimizer.load_state_dict calls, counted by a hook the step registers

    def _walk(self) -> tuple:
        return tuple(self.model.modules()), tuple(self.model.parameters()), tuple(self.model.buffers())

    def tree_changed(self) -> bool:
        """After a registration anywhere, walk the model again; True if its tree changed (plans must be rebuilt)."""
        if self._registrations == REGISTRATIONS.count:
            return False
        self._registrations = REGISTRATIONS.count
        tree = self._walk()
        if any(len(a) != len(b) or any(x is not y for x, y in zip(a, b)) for a, b in zip(tree, self.tree)):
            self.tree, self.tree_version = tree, self.tree_version + 1
            return True
        return False

    def state_key(self, hyperparameter_key: tuple) -> tuple:
        """The key: tree version, loads, train flags, ``requires_grad``, parameter storages, groups, hyperparameters.

        Parameter storages count: ``model.to(...)`` or ``.half()`` after a capture keeps the
        parameter objects but gives them new memory, which a replayed graph would never read.
        """
        modules, params, _ = self.tree
        groups = self.optimizer.param_groups
        # map() over C getters: this runs before every replay, and its time is the step's host overhead
        return (self.tree_version, self.loads[0], tuple(map(_TRAINING, modules)),
                tuple(map(_REQUIRES_GRAD, params)), tuple(map(torch.Tensor.data_ptr, params)),
                tuple([(id(g["params"]), len(g["params"])) for g in groups]), hyperparameter_key)


def hyperparameter_key(optimizer: torch.optim.Optimizer, device_values: bool) -> tuple:
    """What of the hyperparameters a graph bakes in: the update's structure if values live on the device, else all."""
    if device_values:  # values are refreshed before each replay; only the code's shape counts
        return captured_optim.structure(optimizer)
    return tuple(tuple((k, _hashable(v)) for k, v in g.items() if k != "params") for g in optimizer.param_groups)

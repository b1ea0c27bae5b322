"""What a captured step depends on besides its input shapes, read on every call.

A replay reruns the kernels of its capture, so everything the trace read
from Python is frozen in it: the train/eval flag of every module, the
``requires_grad`` of every parameter, the module tree, the parameters'
storages, the param groups and ``optimizer.load_state_dict`` calls. These
are fingerprinted on every call and form part of the graph's key, so a
change gives a new capture, never a replay of a stale graph.

The module tree is walked again only after a registration somewhere:
torch's global registration hooks count them (walking the tree costs about
ten times reading its flags from a kept list). Those hooks are process-wide,
so they are registered while at least one step watches and removed when the
last one is gone.

The graph key holds the state as a number (:meth:`ModelFingerprint.state_id`):
the state itself is a tuple of a few hundred values, which every lookup of the
step's graphs would hash again; here a call compares it once with the last
state and hashes it only where it changed.
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from concur.training import captured_optim

__all__ = ["ModelFingerprint", "hyperparameter_key", "REGISTRATIONS", "STATES_KEPT"]


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
_TRAINING_IN_DICT = operator.itemgetter("training")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
STATES_KEPT = 256  # distinct states numbered before the numbering starts over (graphs of older ones are recaptured)


def _training_flags(modules: tuple[nn.Module, ...]) -> Callable[[], tuple]:
    """A reader of the modules' train flags. ``nn.Module.train`` and ``m.training = x`` both write the flag into
    the module's ``__dict__``, read there without ``nn.Module``'s attribute lookup (about half the time); a
    module that keeps it elsewhere (a property, say), or no longer there, has every flag read as an attribute."""
    def attributes() -> tuple:
        return tuple(map(_TRAINING, modules))

    if not all("training" in vars(m) for m in modules):
        return attributes
    dicts = tuple(vars(m) for m in modules)

    def in_dicts() -> tuple:
        try:
            return tuple(map(_TRAINING_IN_DICT, dicts))
        except KeyError:
            return attributes()
    return in_dicts


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
    """The model's tree, flags and storages and the optimizer's groups, as a key read before every replay."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        REGISTRATIONS.watch()
        weakref.finalize(self, REGISTRATIONS.unwatch)
        self._registrations = REGISTRATIONS.count
        self.tree = self._walk()
        self._flags = _training_flags(self.tree[0])
        self.tree_version = 0
        self.loads = [0]  # optimizer.load_state_dict calls, counted by a hook the step registers
        self._numbers = itertools.count()
        self._states: dict[tuple, int] = {}
        self._last: tuple[tuple | None, int] = (None, -1)

    def _walk(self) -> tuple:
        return tuple(self.model.modules()), tuple(self.model.parameters()), tuple(self.model.buffers())

    def tree_changed(self) -> bool:
        """After a registration anywhere, walk the model again; True if its tree changed (plans must be rebuilt).

        With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``,
        ``.to()``, ``.half()`` and the like put new ``Parameter`` objects into
        the modules' dicts without a registration hook: the tree is then walked
        on every call, or a replay would train the parameters it was captured with.
        """
        if self._registrations == REGISTRATIONS.count and \
                not torch.__future__.get_overwrite_module_params_on_conversion():
            return False
        self._registrations = REGISTRATIONS.count
        tree = self._walk()
        if any(len(a) != len(b) or any(x is not y for x, y in zip(a, b)) for a, b in zip(tree, self.tree)):
            self.tree, self.tree_version = tree, self.tree_version + 1
            self._flags = _training_flags(tree[0])
            return True
        return False

    def state_id(self, hyperparameter_key: tuple) -> int:
        """A number for :meth:`state_key`: equal states, equal numbers; a state not seen before, a new number.

        At most :data:`STATES_KEPT` states are numbered at once (an optimizer
        whose values are baked into its graphs makes a new state per value);
        past that the numbering starts over with numbers never given before,
        so a number never stands for two states.
        """
        state = self.state_key(hyperparameter_key)
        last, number = self._last
        if state != last:
            number = self._states.get(state)
            if number is None:
                if len(self._states) >= STATES_KEPT:
                    self._states.clear()
                number = self._states[state] = next(self._numbers)
            self._last = state, number
        return number

    def state_key(self, hyperparameter_key: tuple) -> tuple:
        """The key: tree version, loads, train flags, ``requires_grad``, parameter storages, groups, hyperparameters.

        Parameter storages count: ``model.to(...)`` or ``.half()`` after a capture keeps the
        parameter objects but gives them new memory, which a replayed graph would never read.
        """
        modules, params, _ = self.tree
        groups = self.optimizer.param_groups
        # map() over C getters: this runs before every replay, and its time is the step's host overhead
        return (self.tree_version, self.loads[0], self._flags(),
                tuple(map(_REQUIRES_GRAD, params)), tuple(map(torch.Tensor.data_ptr, params)),
                tuple([(id(g["params"]), len(g["params"])) for g in groups]), hyperparameter_key)


def hyperparameter_key(optimizer: torch.optim.Optimizer, device_values: bool) -> tuple:
    """What of the hyperparameters a graph bakes in: the update's structure if values live on the device, else all."""
    if device_values:  # values are refreshed before each replay; only the code's shape counts
        return captured_optim.structure(optimizer)
    return tuple(tuple((k, _hashable(v)) for k, v in g.items() if k != "params") for g in optimizer.param_groups)

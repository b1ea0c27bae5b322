"""Batches the model or ``loss_fn`` rejects, told as concur's errors in train_step's own argument names.

At setup, after the plan is built on ``example_batch``, the model and
``loss_fn`` run once more on it (no gradients; buffers and RNG state put
back), so targets that do not fit the loss (another batch size, a wrong
dtype) fail there and not at the first call. Setup errors from the plan name
``example_batch[0]`` where :func:`concur.optimize` would say ``example_inputs``.

At a call, a batch the model rejects (wrong channels, dtype or device)
raises :class:`concur.errors.BatchError` naming ``inputs`` or ``targets`` and
the fix, its traceback starting at the call: torch's error through the
plan's generated code would only bury the mistake. The fast path pays
nothing for this:

- eagerly, nothing is checked before the call; only when the call raises
  is the batch tried on the model itself, to tell whose fault it is;
- under CUDA graphs a replay checks nothing either. Before a new graph is
  captured, its batch is tried on the model and ``loss_fn`` (one forward
  without gradients, beside the capture's own warm-up and capture), because
  a capture that fails falls back to fewer streams for good: a bad batch
  must not cost later batches their streams.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from concur.dag.annotate import preserved_state, tensors_in
from concur.errors import TRACEBACK_HINT, BatchError, ConcurError, ExampleInputError, debug


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


class _Names:
    """How an error spells the batch's parts: ``example_batch[0]``/``[1]`` at setup, ``inputs``/``targets`` later."""

    def __init__(self, inputs: str, targets: str, count: int):
        self.inputs, self.targets, self.count = inputs, targets, count

    def input(self, i: int) -> str:
        return self.inputs if self.count == 1 else f"{self.inputs}[{i}]"

    def call(self) -> str:
        """``model(...)`` called on the inputs, as the user would write it."""
        return f"model({self.inputs})" if self.count == 1 else f"model(*{self.inputs})"


# What a model or loss raises on a batch it cannot take (shape, dtype, device, index errors). Anything else
# (the CUDA sanitizer's race report, a KeyboardInterrupt, a user's own exception) is not the batch's fault
# and goes through as it is.
BATCH_FAULTS = (RuntimeError, ValueError, TypeError, IndexError)

AT_SETUP = "example_batch[0]", "example_batch[1]"
AT_CALL = "inputs", "targets"


@contextlib.contextmanager
def _innermost_module(model: nn.Module, found: list[str]) -> Iterator[None]:
    """Note in ``found`` the path of the innermost submodule running when the block raises (hooks removed after)."""
    entered: list[str] = []

    def left(module: nn.Module, args: Any, output: Any) -> None:  # a hook that returned a value would replace output
        entered.pop()

    handles = []
    for path, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(lambda mod, args, path=path: entered.append(path)))
        handles.append(m.register_forward_hook(left))
    try:
        yield
    except BaseException:
        if entered and entered[-1]:
            path = entered[-1]
            found.append(f"`{path}` ({type(model.get_submodule(path)).__name__})")
        raise
    finally:
        for h in handles:
            h.remove()


class BatchChecks:
    """The batch checks of one :class:`~concur.training.step.TrainStep`; built at its setup (see the module doc)."""

    def __init__(self, step: Any, streams: int):  # a TrainStep, which imports this module
        """Build the step's plan for ``streams`` and try ``example_batch`` on the model and ``loss_fn``.

        Raises:
            ExampleInputError: the model or ``loss_fn`` rejects ``example_batch``; the traceback ends here.
        """
        self.step = step
        inputs, targets = step._arguments["example_batch"]
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        self.example = tuple(inputs), targets
        self.names = _Names(*AT_SETUP, len(inputs))
        try:
            step._module(streams)
        except ExampleInputError as exc:
            raise _cut(self._renamed(exc)) from (exc.original if debug() else None)
        failure = self._try(tuple(inputs), targets, self.names, setup=True)
        if failure is not None:
            raise failure

    # --- at a call --------------------------------------------------------------------------

    def admit(self, inputs: tuple, targets: Any) -> None:
        """Try the batch of a graph about to be captured on the model and ``loss_fn``.

        Raises:
            BatchError: the model or ``loss_fn`` rejects it.
        """
        failure = self._try(inputs, targets, _Names(*AT_CALL, len(inputs)))
        if failure is not None:
            raise failure

    def explain(self, exc: Exception, inputs: tuple, targets: Any) -> ConcurError | None:
        """Return the error to raise for a call that raised ``exc``, or None when the batch is not at fault.

        The batch is tried on the model itself: if the model (or ``loss_fn``)
        raises too, the batch is wrong and the error says how; if not, ``exc``
        is concur's or the plan's and is raised unchanged.
        """
        if isinstance(exc, BatchError):
            return _cut(exc)
        if isinstance(exc, (ConcurError, torch.OutOfMemoryError, MemoryError)):
            return None
        return self._try(inputs, targets, _Names(*AT_CALL, len(inputs)))

    # --- trying a batch ---------------------------------------------------------------------

    def _try(self, inputs: tuple, targets: Any, names: _Names, setup: bool = False) -> ConcurError | None:
        """Run the model and ``loss_fn`` on the batch without gradients, state put back; return the error, if any."""
        step = self.step
        model = step.model
        devices = {t.device for t in tensors_in((inputs, targets))} | {p.device for p in model.parameters()}
        output = None
        try:
            with step.setup_stream(), preserved_state(model, devices), torch.no_grad(), step._body.autocast(inputs):
                output = model(*inputs)
                loss = step.loss_fn(output, targets)
        except (torch.OutOfMemoryError, MemoryError):
            raise
        except BATCH_FAULTS as cause:
            if output is None:
                return self._model_error(cause, inputs, names, self._where(inputs, devices), setup)
            return self._loss_error(cause, output, targets, names, setup)
        if setup and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            got = _describe(loss) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise _cut(ExampleInputError(
                f"concur: loss_fn(model(*inputs), targets) on example_batch returns {got}, not one number: "
                "train_step calls backward() on it. Fix: reduce it to a scalar (reduction='mean' or "
                "'sum').", names.targets))
        return None

    def _where(self, inputs: tuple, devices: set) -> str:
        """Return the innermost submodule raising on ``inputs``: the model runs again, under hooks (failures only)."""
        found: list[str] = []
        with contextlib.suppress(Exception), self.step.setup_stream(), preserved_state(self.step.model, devices), \
                torch.no_grad(), self.step._body.autocast(inputs), _innermost_module(self.step.model, found):
            self.step.model(*inputs)
        return found[0] if found else "the model"

    def _model_error(self, cause: Exception, inputs: tuple, names: _Names, where: str,
                     setup: bool) -> ConcurError:
        argument, fix = self._input_fix(inputs, names, setup)
        shapes = ", ".join(_describe(t) for t in tensors_in(inputs)) or "no tensors"
        if fix is None:
            argument = names.inputs
            fix = (f"the model fails on {names.inputs} ({shapes}). Fix: pass {names.inputs} that "
                   f"`{names.call()}` accepts")
        return self._error(fix, f"torch raised in {where}: {type(cause).__name__}: {_first_line(cause)}",
                           argument, cause, setup)

    def _loss_error(self, cause: Exception, output: Any, targets: Any, names: _Names,
                    setup: bool) -> ConcurError:
        out = ", ".join(_describe(t) for t in tensors_in(output)) or type(output).__name__
        got = ", ".join(_describe(t) for t in tensors_in(targets)) or type(targets).__name__
        hint = ""
        out_t, tgt_t = tensors_in(output), tensors_in(targets)
        if out_t and tgt_t and out_t[0].dim() and tgt_t[0].dim() and len(out_t[0]) != len(tgt_t[0]):
            hint = f" ({len(tgt_t[0])} targets for a batch of {len(out_t[0])})"
        if not setup:
            example = tensors_in(self.example[1])
            if example and tgt_t and example[0].dtype != tgt_t[0].dtype:
                hint += f" (example_batch's targets were {example[0].dtype})"
        fix = (f"loss_fn fails on the model's output ({out}) and {names.targets} ({got}){hint}. Fix: pass "
               f"{names.targets} that `loss_fn({names.call()}, {names.targets})` accepts, one per "
               f"example of the batch")
        return self._error(fix, f"torch raised in loss_fn: {type(cause).__name__}: {_first_line(cause)}",
                           names.targets, cause, setup)

    def _input_fix(self, inputs: tuple, names: _Names, setup: bool) -> tuple[str, str | None]:
        """Return (the argument, what is wrong with it and the fix) for the first input unlike the model or example."""
        state = [*self.step.model.parameters(), *self.step.model.buffers()]
        devices = {t.device for t in state}
        dtypes = {t.dtype for t in state if t.is_floating_point()}
        examples = self.example[0]
        for i, value in enumerate(inputs):
            name = names.input(i)
            seen = tensors_in(examples[i]) if i < len(examples) and not setup else []
            for j, t in enumerate(tensors_in(value)):
                if len(devices) == 1 and t.device not in devices:
                    (device,) = devices
                    return name, (f"{name} is on {t.device} but the model's parameters are on {device}. "
                                  f"Fix: pass `{name}.to('{device}')`")
                if len(dtypes) == 1 and t.is_floating_point() and t.dtype not in dtypes:
                    (dtype,) = dtypes
                    return name, (f"{name} is {t.dtype} but the model's parameters are {dtype}. "
                                  f"Fix: pass `{name}.to({dtype})`")
                if j < len(seen):
                    e = seen[j]
                    if t.dtype != e.dtype:
                        return name, (f"{name} is {t.dtype} where example_batch's was {e.dtype}. "
                                      f"Fix: pass `{name}.to({e.dtype})`")
                    if t.dim() != e.dim():
                        return name, (f"{name} has {t.dim()} dimensions ({list(t.shape)}) where "
                                      f"example_batch's had {e.dim()} ({list(e.shape)}). Fix: pass {name} "
                                      "shaped as the model takes it")
                    differ = [d for d in range(1, t.dim()) if t.shape[d] != e.shape[d]]
                    if differ:
                        dims = ", ".join(map(str, differ))
                        return name, (f"{name} has shape {list(t.shape)} where example_batch's had "
                                      f"{list(e.shape)} (dimension {dims} differs). Fix: pass {name} "
                                      "shaped as the model takes it; the batch size (dimension 0) may "
                                      "change: each batch size gets its own graph")
        return names.inputs, None

    def _error(self, fix: str, torch_says: str, argument: str, cause: Exception, setup: bool) -> ConcurError:
        where = "" if setup else "step(inputs, targets): "
        kind = ExampleInputError if setup else BatchError
        error = kind(f"concur: {where}{fix}.\n{torch_says} {TRACEBACK_HINT}", argument, cause)
        error.__cause__ = cause if debug() else None
        error.__suppress_context__ = True
        return _cut(error)

    def _renamed(self, exc: ExampleInputError) -> ExampleInputError:
        """Return ``exc`` (from :func:`concur.optimize`) reworded in train_step's names (example_batch[0])."""
        count = self.names.count
        text, argument = str(exc), exc.argument
        for i in range(count):
            text = text.replace(f"example_inputs[{i}]", self.names.input(i))
            argument = argument.replace(f"example_inputs[{i}]", self.names.input(i))
        text = text.replace("model(*example_inputs)", self.names.call()).replace("example_inputs", self.names.inputs)
        text = text.replace("concur.optimize", "concur.train_step")
        exc.args, exc.argument = (text,), argument.replace("example_inputs", self.names.inputs)
        return exc


def _cut(error: ConcurError) -> ConcurError:
    """Return ``error`` with its traceback cut to the public call, unless ``CONCUR_DEBUG`` asks for it all."""
    return error if debug() else error.with_traceback(None)

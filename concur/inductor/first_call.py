"""Decide whether a compiled graph runs on several streams at its first call, timed on that call's own inputs.

Timing inductor's one-stream call against the rewritten one needs inputs.
At compile time there are only fake ones, and real ones made to match cost
memory (:func:`concur.dag.measure.real_inputs`): a backward, compiled lazily
at the first backward call while the forward's saved activations are alive,
would make a second set of them, beyond the recipe's memory. So where a measurement is wanted,
:func:`concur.inductor.placement.place_kernels` installs a
:class:`FirstCall` in the graph's place, which times both programs on the
inputs of the graph's first call, hands the rounds to the one decision point
(:func:`concur.dag.decide.decide`: same INFO line, same cache), installs the
chosen program in its own place and is never called again.

What the user sees must be what inductor's own call would give. Which
inputs a call writes is read from its wrapper
(:func:`concur.inductor.wrapper_emit.written_inputs`); which of them it
means to mutate, from inductor (:func:`concur._torch_compat.inductor_mutated_inputs`)::

    inputs the graph mutates (a training forward's BatchNorm statistics)
        copied before timing and back after (:func:`concur.dag.measure.boxed_rounds`)
    the random number generators
        put back after timing (:func:`concur.dag.measure.rng_kept`)
    a call that writes no input but those it mutates (every forward)
        times first, then runs the chosen program for the real result, so
        the outputs of timing and of the real call are never alive together
    a call that overwrites inputs it does not mutate (a backward's donated buffers)
        runs inductor's own call first, on the real values, and returns its
        result; timing then runs on what the call left, except where that
        memory now holds one of the call's outputs, or holds integers (a
        garbage index could fault), which are timed on made-up tensors of
        their shape instead

A timing that fails, or a first call made while a CUDA graph is being
captured, leaves the decision to the prediction, as without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

import torch

from concur.dag import decide
from concur.dag.measure import boxed_rounds, real_inputs


class Deferred(BaseException):
    """Raised by :func:`defer` when :func:`concur.dag.decide.decide` would time: the first call will.

    A ``BaseException`` because ``decide`` takes a timer's ``Exception`` for a
    failed timing and decides by the prediction; this one must pass through
    it, before it logs or caches anything.
    """


def defer() -> NoReturn:
    """The timer given to ``decide`` at compile time: reaching it means no cached decision and a plan worth timing."""
    raise Deferred


@dataclass(frozen=True)
class FirstCallTiming:
    """Where a graph's first call can time its programs, and whether it can when it comes."""

    device: torch.device
    can_time: Callable[[], bool]  # asked again at the first call (not while a CUDA graph is being captured)


class FirstCall:
    """A compiled graph's boxed call that, on its first call, times, decides, installs the winner and runs.

    ``own`` is inductor's one-stream call; ``streams`` the rewritten ones
    (one per candidate plan, :func:`concur.dag.decide.choose`).
    ``settle(timer)`` decides with ``timer`` through
    :func:`concur.dag.decide.choose`, installs the chosen call where this
    one was (so later calls never pass through here) and returns it.
    ``mutated`` are the input positions inductor says it writes;
    ``written`` those its wrapper may write (concur's read, a superset) out
    of ``num_inputs``, or None where they could not be read.
    """

    def __init__(self, own: Callable[[list], Any], streams: Sequence[Callable[[list], Any]],
                 settle: Callable[[decide.Timer], Callable[[list], Any]], timing: FirstCallTiming,
                 mutated: frozenset[int], written: frozenset[int] | None, num_inputs: int):
        self.own, self.streams, self.settle, self.timing = own, tuple(streams), settle, timing
        self.mutated, self.written, self.num_inputs = mutated, written, num_inputs

    def __call__(self, args: list) -> Any:
        if not self.timing.can_time():
            return self.settle(_cannot_time)(args)
        # where the wrapper's inputs were not read as these arguments, any of them may be written
        written = self.written if len(args) == self.num_inputs else None
        kept = list(args)  # inductor's call empties ``args`` and frees each input after its last use
        if written is None or not written <= self.mutated:
            # the call may overwrite inputs it does not restore (donated buffers): it runs on them first
            result = self.own(args)
            timer = self._time(lambda: self._timing_inputs(kept, result, written))
            kept.clear()
            self.settle(timer)
            return result
        timer = self._time(lambda: kept)
        kept.clear()
        return self.settle(timer)(args)

    def _timing_inputs(self, kept: list, result: Any, written: frozenset[int] | None) -> list:
        """Return the inputs to time on after the real call: ``kept``, but for those whose values must not be touched.

        An input the call may have overwritten, without restoring it, is
        replaced by a made-up tensor of its shape where its memory holds an
        output the user will read (timing would write into it) or where it
        holds integers (the garbage left there may index out of bounds).
        """
        outputs = {t.untyped_storage().data_ptr() for t in _tensors(result)} - {0}
        args = list(kept)
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor) or i in self.mutated:
                continue
            if written is not None and i not in written:
                continue
            if x.untyped_storage().data_ptr() in outputs or not (x.is_floating_point() or x.is_complex()):
                args[i] = real_inputs([x])[0]
        return args

    def _time(self, inputs: Callable[[], list]) -> decide.Timer:
        """Time both programs on ``inputs()`` now; return a timer that hands ``decide`` the rounds, or the failure."""
        try:
            rounds = boxed_rounds((self.own, *self.streams), inputs(), self.timing.device, self.mutated)
        except Exception as exc:  # noqa: BLE001 - decide logs it and lets the prediction decide
            failure = exc

            def failed() -> NoReturn:
                raise failure

            return failed
        return lambda: rounds


def _cannot_time() -> NoReturn:
    raise RuntimeError("nothing could be timed at the graph's first call (a CUDA graph was being captured, "
                       "or CONCUR_MEASURE=0)")


def _tensors(result: Any) -> list[torch.Tensor]:
    """Return the tensors among a boxed call's outputs (a tuple or list of tensors, ``None`` s and numbers)."""
    items = result if isinstance(result, (list, tuple)) else [result]
    return [t for t in items if isinstance(t, torch.Tensor)]

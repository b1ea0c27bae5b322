"""concur's exceptions: each says what went wrong, where, and what to do about it.

An error about the user's own input or model keeps the exception torch
raised (``.original``, also ``__context__``) without printing its traceback,
which is torch's insides and runs to dozens of lines; ``CONCUR_DEBUG=1`` in
the environment chains and prints it as ``raise ... from`` would.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

__all__ = ["debug", "exception_chain", "says_out_of_memory", "failure_text", "ConcurError", "CaptureError",
           "ExampleInputError", "BatchError", "PlanError"]

DEBUG_ENV = "CONCUR_DEBUG"


def debug() -> bool:
    """Return True when ``CONCUR_DEBUG`` asks for torch's full tracebacks under concur's errors."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


TRACEBACK_HINT = f"(torch's traceback: the exception's .original, or set {DEBUG_ENV}=1)"


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or while handling, each once (a chain may loop back on itself)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def says_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` itself says the device ran out of memory: torch's ``OutOfMemoryError``, or the driver's
    "out of memory" raised as another error."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()


def failure_text(exc: BaseException) -> str:
    """``exc`` in a few words for a warning or a decision's reason: the type and first line of its message, or of
    the link of its chain that ran out of memory where one did. A capture that runs out of memory mid-way fails
    at its end with another error ("capturing stream has unjoined work"), raised while the allocator's is
    handled: that one says nothing of the cause.

    >>> try:
    ...     try:
    ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
    ...     except torch.OutOfMemoryError:
    ...         raise RuntimeError("CUDA error: capturing stream has unjoined work")
    ... except RuntimeError as exc:
    ...     failure_text(exc)
    'OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.'
    """
    told = next((link for link in exception_chain(exc) if says_out_of_memory(link)), exc)
    return f"{type(told).__name__}: {(str(told).splitlines() or [''])[0][:200]}"


class ConcurError(RuntimeError):
    """Base class of every error concur raises on purpose."""

    original: BaseException | None = None  # the exception torch raised, where there is one


class CaptureError(ConcurError):
    """torch.fx could not trace the model.

    Attributes name the innermost module being traced when tracing failed and
    the user's source line, so the message can point at the code to change.
    """

    def __init__(self, message: str, module_path: str, module_type: str, location: str | None):
        super().__init__(message)
        self.module_path = module_path
        self.module_type = module_type
        self.location = location


class ExampleInputError(ConcurError):
    """The model raised on the example inputs concur runs it on at setup (wrong dtype, device, shape...).

    ``argument`` names the input at fault (``"example_inputs[0]"``) or all of
    them (``"example_inputs"``); ``original`` is the exception torch raised.
    """

    def __init__(self, message: str, argument: str, original: BaseException | None = None):
        super().__init__(message)
        self.argument = argument
        self.original = original


class BatchError(ConcurError):
    """A batch given to a train_step at a call that the model or ``loss_fn`` rejects (wrong channels, dtype, device...).

    ``argument`` names the part at fault (``"inputs"``, ``"inputs[1]"``,
    ``"targets"``); ``original`` is the exception torch raised. The call did
    not count: the accumulation cycle goes on with the next batch that fits.
    """

    def __init__(self, message: str, argument: str, original: BaseException | None = None):
        super().__init__(message)
        self.argument = argument
        self.original = original


class PlanError(ConcurError):
    """A generated plan failed its own consistency check (a concur bug, never a user error)."""

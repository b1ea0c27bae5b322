"""Telling an out-of-memory failure from other failures of setup, and saying how much memory was missing.

Setup (a trial of programs, a timing, a warm-up, a capture) must never cost
the user's run: where a program of several streams does not fit, the step
runs fewer streams or one, and says by how much it missed. Torch's caching
allocator raises ``torch.OutOfMemoryError`` with the request and what was
free in its message; a graph that does not fit when instantiated raises the
driver's "out of memory" as a plain ``RuntimeError``.
"""

from __future__ import annotations

import re

from concur.errors import exception_chain, says_out_of_memory

__all__ = ["is_out_of_memory", "shortfall"]

_REQUEST = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")
_FREE = re.compile(r"of which ([0-9.]+ [KMGT]?i?B) is free")
_LIMIT = re.compile(r"([0-9.]+ [KMGT]?i?B) allowed;")  # under torch.cuda.set_per_process_memory_fraction


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from or during, says the device ran out of memory: torch's
    ``OutOfMemoryError``, or the driver's "out of memory" raised as another error. A capture that runs out of
    memory mid-way fails at its end with another error ("capturing stream has unjoined work"), raised while the
    allocator's is handled: the cause is the one in the chain."""
    return any(says_out_of_memory(e) for e in exception_chain(exc))


def shortfall(exc: BaseException) -> str:
    """How much memory ``exc`` says was missing, in words: the request, what was free, the process's limit.

    >>> shortfall(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
    ...     "capacity of 139.81 GiB of which 12.00 MiB is free."))
    'an allocation of 20.00 MiB did not fit in the 12.00 MiB free'
    >>> shortfall(RuntimeError("CUDA error: out of memory"))
    'CUDA error: out of memory'
    """
    # the allocator's error says what was missing, where a capture's end raised another while handling it
    exc = next((e for e in exception_chain(exc) if _REQUEST.search(str(e))), exc)
    text = str(exc)
    request, free, limit = (m.group(1) if m else None for m in (_REQUEST.search(text), _FREE.search(text),
                                                                 _LIMIT.search(text)))
    if request is None:
        return (text.splitlines() or [type(exc).__name__])[0][:200]
    said = f"an allocation of {request} did not fit"
    if free is not None:
        said += f" in the {free} free"
    if limit is not None:
        said += f" (the process may use {limit})"
    return said

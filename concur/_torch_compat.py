"""The one place that touches private or version-dependent PyTorch APIs.

Everything here is checked against the installed torch version, so that a
future release that moves an internal breaks one small function with a clear
message instead of a silent wrong result somewhere deep in concur.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

MIN_TORCH = (2, 4)


def torch_version() -> tuple[int, int]:
    """Return (major, minor) of the installed torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


if torch_version() < MIN_TORCH:  # pragma: no cover - guarded by pyproject
    raise ImportError(
        f"concur needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}; "
        "upgrade with `pip install -U torch`."
    )


def version_counter(t: torch.Tensor) -> int:
    """Return the in-place version counter of ``t`` (shared by all views of a storage).

    ``Tensor._version`` is private but has been stable since torch 1.0; every
    in-place op, including those inside leaf modules and custom ops, bumps it.
    """
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


@contextlib.contextmanager
def cuda_sanitizer() -> Iterator[None]:
    """Enable PyTorch's CUDA stream sanitizer (CSAN) for the duration of the block.

    CSAN reports unsynchronized cross-stream accesses as ``CUDASanitizerErrors``
    raised from the offending kernel launch. It lives in the private module
    ``torch.cuda._sanitizer``; it cannot be disabled once enabled, so callers
    should run it in a dedicated process (the GPU tests do).
    """
    try:
        from torch.cuda import _sanitizer
    except ImportError as exc:  # pragma: no cover - depends on torch build
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda._sanitizer") from exc
    _sanitizer.enable_cuda_sanitizer()
    yield

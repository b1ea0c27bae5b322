"""Trace an unmodified model into a torch.fx GraphModule, with errors that say what to fix.

The tracer remembers which submodule it was inside when tracing failed and
which line of the user's code triggered it, so that a model with
data-dependent control flow gets a message naming the module, the source
line, and the two ways out (mark the module a leaf, or ``fallback="eager"``).
"""

from __future__ import annotations

import os
import traceback
from typing import Iterable

import torch
import torch.fx as fx

from .errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_CONCUR_DIR = os.path.dirname(__file__)

LeafSpec = Iterable["type[torch.nn.Module] | str"]


class _ConcurTracer(fx.Tracer):
    """fx.Tracer that honours user leaf modules and records where tracing failed.

    Buffers are proxied like parameters: by default fx hands the real buffer
    to the forward, so ``self.ema.mul_(0.9)`` would run once, at trace time,
    on the real buffer, and be baked into the graph as a constant.
    """

    def __init__(self, leaf_modules: LeafSpec = ()):
        super().__init__()
        self.proxy_buffer_attributes = True
        leaves = list(leaf_modules)
        self._leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self._leaf_paths = frozenset(x for x in leaves if isinstance(x, str))
        self.failed_module: tuple[str, torch.nn.Module] | None = None

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self._leaf_types) or module_qualified_name in self._leaf_paths:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:  # innermost module wins: it is set first
                self.failed_module = (self.path_of_module(m), m)
            raise


def _user_location(exc: BaseException) -> str | None:
    """Return 'file:line: source' of the innermost frame outside torch and concur."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not (path.startswith(_TORCH_DIR) or path.startswith(_CONCUR_DIR)):
            src = (frame.line or "").strip()
            return f"{frame.filename}:{frame.lineno}: {src}"
    return None


def trace(model: torch.nn.Module, leaf_modules: LeafSpec = ()) -> fx.GraphModule:
    """Return a GraphModule of ``model`` traced by torch.fx.

    Raises:
        CaptureError: naming the module and source line fx could not trace.
    """
    tracer = _ConcurTracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as exc:
        path, module = tracer.failed_module or ("", model)
        where = f"`{path}` ({type(module).__name__})" if path else f"the forward of {type(model).__name__}"
        location = _user_location(exc)
        fix_leaf = f"leaf_modules=[{type(module).__name__}]" if path else "leaf_modules=[...] naming the submodule with the control flow"
        msg = (
            f"concur could not trace {where}"
            + (f" at {location}" if location else "")
            + f": {type(exc).__name__}: {exc}\n"
            f"Fix: keep that module whole as one opaque operation with "
            f"concur.optimize(model, inputs, {fix_leaf}), "
            f"or pass fallback='eager' to run the model unchanged."
        )
        raise CaptureError(msg, path, type(module).__name__, location) from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)

"""Trace an unmodified model into a torch.fx GraphModule, with errors that say what to fix.

The tracer remembers which submodule it was inside when tracing failed and
which line of the user's code triggered it, so that a model with
data-dependent control flow gets a message naming the module, the source
line, and the two ways out (mark the module a leaf, or ``fallback="eager"``).

Partial capture (``leaf_modules="auto"``) takes the first way out by itself:
it retraces with the failing submodule as a leaf, the innermost one first so
that as much of the model as possible stays traced, until tracing succeeds or
the root's own forward fails. The resulting leaves are opaque ``call_module``
nodes: the annotation pass still sees their reads, writes and FLOPs on the
example input, and concurrency applies between them.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections import Counter
from typing import Iterable, Literal, Union

import torch
import torch.fx as fx

from .errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_CONCUR_DIR = os.path.dirname(__file__)

AUTO = "auto"
LeafSpec = Union[Iterable["type[torch.nn.Module] | str"], Literal["auto"]]
AUTO_LEAVES_META = "concur_auto_leaves"  # GraphModule.meta key: paths made leaves by "auto"


class _ConcurTracer(fx.Tracer):
    """fx.Tracer that honours user leaf modules and records where tracing failed.

    Buffers are proxied like parameters: by default fx hands the real buffer
    to the forward, so ``self.ema.mul_(0.9)`` would run once, at trace time,
    on the real buffer, and be baked into the graph as a constant.
    """

    def __init__(self, leaf_modules: Iterable["type[torch.nn.Module] | str"] = ()):
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


def _user_stacklevel() -> int:
    """Return the ``stacklevel`` that makes a warning point at the first caller outside concur."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_CONCUR_DIR):
        frame, level = frame.f_back, level + 1
    return level


def trace(model: torch.nn.Module, leaf_modules: LeafSpec = ()) -> fx.GraphModule:
    """Return a GraphModule of ``model`` traced by torch.fx.

    ``leaf_modules`` lists module types or qualified paths kept whole as one
    opaque node, or is ``"auto"``: every submodule fx fails in becomes a leaf,
    with a ``UserWarning`` naming them; their paths are in
    ``result.meta["concur_auto_leaves"]`` (empty when nothing failed).

    Raises:
        CaptureError: naming the module and source line fx could not trace
            (with ``"auto"``: only when the root's own forward fails).
    """
    if isinstance(leaf_modules, str) and leaf_modules != AUTO:
        raise ValueError(f'leaf_modules must be a list of module types or paths, or "auto"; got {leaf_modules!r}')
    if leaf_modules != AUTO:
        return _trace_once(model, tuple(leaf_modules))
    auto: list[str] = []
    while True:
        try:
            gm = _trace_once(model, tuple(auto))
            break
        except CaptureError as exc:
            if not exc.module_path or exc.module_path in auto:  # the root failed: nothing left to cut
                if auto:
                    exc.args = (f"{exc.args[0]}\n(leaf_modules='auto' already made leaves of: "
                                f"{', '.join(auto)})",)
                raise
            auto.append(exc.module_path)
    # A leaf inside a later, outer leaf is never called by the graph: report only the outer one.
    used = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    leaves = tuple(p for p in auto if p in used)
    gm.meta[AUTO_LEAVES_META] = leaves
    if leaves:
        types = Counter(type(model.get_submodule(p)).__name__ for p in leaves)
        kinds = ", ".join(f"{n} {t}" for t, n in types.items())
        shown = ", ".join(leaves[:8]) + (f", ... ({len(leaves) - 8} more)" if len(leaves) > 8 else "")
        warnings.warn(f"concur could not trace {len(leaves)} submodule(s) ({kinds}) and keeps each whole as "
                      f"one opaque operation (leaf_modules='auto'): {shown}; all are listed in "
                      f"`.auto_leaves`", UserWarning, stacklevel=_user_stacklevel())
    return gm


def _trace_once(model: torch.nn.Module, leaf_modules: tuple) -> fx.GraphModule:
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
            f"concur.optimize(model, inputs, {fix_leaf}) or leaf_modules='auto', "
            f"or pass fallback='eager' to run the model unchanged."
        )
        raise CaptureError(msg, path, type(module).__name__, location) from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.meta[AUTO_LEAVES_META] = ()
    return gm

"""Trace an unmodified model into a torch.fx GraphModule, with errors that say what to fix.

The tracer remembers which submodule it was inside when tracing failed and
which line of the user's code triggered it, so that a model with
data-dependent control flow gets a message naming the module, the source
line, and the two ways out (mark the module a leaf, or ``fallback="eager"``).

Control flow in the root module's own code (its forward, or a function the
forward calls) has no submodule around it to keep whole, so the message
says so and offers the ways that can work there: ``fallback="eager"``, or
keeping the function out of the trace (``torch.fx.wrap``). Module types and
functions timm marks as not-to-be-traced for fx are honoured as timm's own
feature extractor honours them: as leaves and as wrapped functions.

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
from typing import Callable, Iterable, Literal, Union

import torch
import torch.fx as fx

from concur.dag.annotate import AUGMENTED_ASSIGNMENTS
from concur.errors import TRACEBACK_HINT, CaptureError, debug

_TORCH_DIR = os.path.dirname(torch.__file__)
_CONCUR_DIR = os.path.dirname(__file__)

AUTO = "auto"
LeafSpec = Union[Iterable["type[torch.nn.Module] | str"], Literal["auto"]]
AUTO_LEAVES_META = "concur_auto_leaves"  # GraphModule.meta key: paths made leaves by "auto"
# Where timm keeps its not-to-be-traced registries, newest first.
_TIMM_FX_REGISTRIES = ("timm.layers._fx", "timm.models._features_fx", "timm.models.fx_features")


def timm_notrace() -> tuple[tuple[type, ...], tuple[Callable, ...]]:
    """Return the module types and functions timm marks as not to be traced by fx (empty without timm).

    timm is never imported here: a timm model has imported it already.
    """
    for name in _TIMM_FX_REGISTRIES:
        registry = sys.modules.get(name)
        if registry is None:
            continue
        get_modules = getattr(registry, "get_notrace_modules", None)
        get_functions = getattr(registry, "get_notrace_functions", None)
        modules = get_modules() if callable(get_modules) else getattr(registry, "_leaf_modules", None)
        functions = get_functions() if callable(get_functions) else getattr(registry, "_autowrap_functions", None)
        if modules is not None and functions is not None:
            return (tuple(m for m in modules if isinstance(m, type)),
                    tuple(f for f in functions if callable(f)))  # timm also takes names: fx needs objects
    if "timm" in sys.modules and not _warned_timm:
        _warned_timm.append(True)
        warnings.warn("concur found no fx registry in this timm version (timm.layers._fx and older places): "
                      "modules and functions timm marks as not-to-be-traced are traced like the rest; if "
                      "tracing fails, pass them as leaf_modules=[...] or use fallback='eager'",
                      UserWarning, stacklevel=_user_stacklevel())
    return (), ()


_warned_timm: list[bool] = []  # the registry warning is given once per process


class _InPlaceProxy(fx.Proxy):
    """A Proxy that records ``a += b`` as the in-place operation the model runs (``operator.iadd``).

    Traced as fx does by itself (``a = a + b``), ``out += identity`` would make
    a new tensor where the model writes into ``out``: another name still holding
    ``out`` (``kept = out`` before the add) would not see the change eager
    PyTorch makes, a silently different result, and a residual add would cost a
    buffer the model does not allocate (fx's own Proxy has no ``__iadd__``). The
    DAG orders the write like any other in-place op
    (:data:`concur.dag.annotate.AUGMENTED_ASSIGNMENTS`).
    """


def _inplace_method(target: Callable) -> Callable:
    def method(self: fx.Proxy, other: object) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", target, (self, other), {})
    return method


for _target in AUGMENTED_ASSIGNMENTS:  # operator.iadd -> __iadd__, ...
    setattr(_InPlaceProxy, f"__{_target.__name__}__", _inplace_method(_target))
del _target


class _ConcurTracer(fx.Tracer):
    """fx.Tracer that honours user leaf modules and records where tracing failed.

    Buffers are proxied like parameters: by default fx hands the real buffer
    to the forward, so ``self.ema.mul_(0.9)`` would run once, at trace time,
    on the real buffer, and be baked into the graph as a constant.
    """

    def __init__(self, leaf_modules: Iterable["type[torch.nn.Module] | str"] = ()):
        timm_modules, timm_functions = timm_notrace()
        super().__init__(autowrap_functions=timm_functions)
        self.proxy_buffer_attributes = True
        leaves = list(leaf_modules)
        self._leaf_types = tuple(x for x in leaves if isinstance(x, type)) + timm_modules
        self._leaf_paths = frozenset(x for x in leaves if isinstance(x, str))
        self.failed_module: tuple[str, torch.nn.Module] | None = None

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)

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


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """Return the frames of the traceback outside torch and concur (the user's code), outermost first."""
    frames = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if not (path.startswith(_TORCH_DIR) or path.startswith(_CONCUR_DIR)):
            frames.append(frame)
    return frames


def _location(frame: traceback.FrameSummary | None) -> str | None:
    """Return 'file:line: source' of a frame."""
    return None if frame is None else f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"


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
            gm = _trace_once(model, tuple(auto), auto_tried=True)
            break
        except CaptureError as exc:
            if not exc.module_path or exc.module_path in auto:  # the root failed: nothing left to cut
                if auto:
                    made = f"(leaf_modules='auto' already made leaves of: {', '.join(auto)})"
                    exc.args = (exc.args[0].replace(TRACEBACK_HINT, f"{made}\n{TRACEBACK_HINT}"),)
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


def _trace_once(model: torch.nn.Module, leaf_modules: tuple, auto_tried: bool = False) -> fx.GraphModule:
    tracer = _ConcurTracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as exc:
        error = _capture_error(model, tracer.failed_module, exc, auto_tried)
        raise error from (exc if debug() else None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.meta[AUTO_LEAVES_META] = ()
    return gm


def _capture_error(model: torch.nn.Module, failed: tuple[str, torch.nn.Module] | None, exc: Exception,
                   auto_tried: bool) -> CaptureError:
    """Return the CaptureError for ``exc``, with the fix that can work where the trace failed.

    In a submodule, keeping that submodule whole works. In the root's own
    code nothing can be kept whole around it: only running the model
    unchanged, or keeping the function with the control flow out of the
    trace, can.
    """
    path, module = failed or ("", model)
    frames = _user_frames(exc)
    frame = frames[-1] if frames else None
    location = _location(frame)
    at = f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else ""
    what = f"{type(exc).__name__}: {exc}"
    if path:
        auto = "" if auto_tried else " or leaf_modules='auto'"
        msg = (f"concur could not trace `{path}` ({type(module).__name__}){at}: {what}\n"
               f"Fix: keep that module whole as one opaque operation with concur.optimize(model, inputs, "
               f"leaf_modules=[{type(module).__name__}]){auto}, or pass fallback='eager' to run the model "
               f"unchanged.")
    else:
        name = type(model).__name__
        inside = f" in {frame.name}()" if frame and frame.name != "forward" else ""
        msg = (f"concur could not trace {name}'s own code{inside}{at}: {what}\n"
               f"This code is the root module's own, not a submodule's, so no leaf module can keep "
               f"it out of the trace" + (" (leaf_modules='auto' tried)" if auto_tried else "")
               + ".\nFix: pass fallback='eager' to run the model unchanged, or keep "
               + _wrap_advice(model, frames))
    error = CaptureError(f"{msg}\n{TRACEBACK_HINT}", path, type(module).__name__, location)
    error.original = exc
    return error


def _wrap_advice(model: torch.nn.Module, frames: list[traceback.FrameSummary]) -> str:
    """Say how to keep the function holding the failing code out of the trace.

    ``torch.fx.wrap`` patches the name in the globals of the file it is
    called in, so it belongs in the file that *calls* the function.
    """
    function = frames[-1].name if frames else ""
    if not function or function == "<module>" or hasattr(type(model), function):  # a method of the model
        return ("those lines out of the trace: move them into a module-level function and mark it with "
                "torch.fx.wrap('that_function') at the top level of the file that calls it (fx then calls "
                "it as one operation).")
    caller = os.path.basename(frames[-2].filename) if len(frames) > 1 else "the file that calls it"
    advice = (f"`{function}` out of the trace: torch.fx.wrap('{function}') at the top level of {caller} "
              f"makes fx call it as one operation")
    if type(model).__module__.split(".")[0] == "timm":
        advice += (f", or, without editing timm, timm.layers.register_notrace_function({function}) "
                   f"(concur honours timm's not-traced marks)")
    return advice + "."

"""The one place that touches private or version-dependent PyTorch APIs.

Everything here is checked against the installed torch version, so that a
future release that moves an internal breaks one small function with a clear
message instead of a silent wrong result somewhere deep in concur.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Callable, Iterator

import torch

MIN_TORCH = (2, 4)
# The torch.compile backend reads inductor's generated code, which no release promises to keep:
# these (major, minor) bounds, inclusive, are the releases it was tested on (2.11 on the H100,
# 2.13 and 2.14 on the CPU). Outside them it warns once and relies on failing closed.
TESTED_TORCH = ((2, 11), (2, 14))


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


# --- torch.compile internals used by concur.backend -------------------------------------------
# Tested on TESTED_TORCH. Each accessor imports lazily so that `import concur` never pays for (or
# breaks on) inductor.

_warned_untested: list[tuple[int, int]] = []  # the version warned about, once per process


def untested_torch() -> str | None:
    """Return why the installed torch is outside :data:`TESTED_TORCH` for the compile backend, or None."""
    version, (low, high) = torch_version(), TESTED_TORCH
    if low <= version <= high:
        return None
    return (f"torch {torch.__version__} is outside the range concur's torch.compile backend was tested on "
            f"({low[0]}.{low[1]} to {high[0]}.{high[1]}): inductor's generated code may have changed, so every "
            "graph whose wrapper concur does not fully read runs as plain inductor output (with a warning)")


def warn_if_untested_torch() -> None:
    """Warn once per process if the installed torch is outside :data:`TESTED_TORCH`."""
    reason = untested_torch()
    if reason is not None and not _warned_untested:
        _warned_untested.append(torch_version())
        warnings.warn(f"concur backend: {reason}", stacklevel=3)

def _compile_internal(what: str, exc: Exception) -> RuntimeError:
    low, high = TESTED_TORCH
    return RuntimeError(
        f"concur's torch.compile backend needs {what}, which torch {torch.__version__} does not "
        f"provide ({type(exc).__name__}: {exc}). It is tested on torch {low[0]}.{low[1]} to "
        f"{high[0]}.{high[1]}; use backend='inductor' or concur.train_step(compile=False) on this version.")


def inductor_compile_fx(gm: torch.fx.GraphModule, example_inputs: list, inner_compile) -> object:
    """Run inductor's whole front end (decompositions, AOTAutograd, partitioner) with our inner compiler.

    ``inner_compile(gm, example_inputs, **kwargs)`` receives each forward and
    backward aten graph exactly as inductor's own ``compile_fx_inner`` would.
    """
    try:
        from torch._inductor.compile_fx import compile_fx
    except ImportError as exc:  # pragma: no cover - depends on torch version
        raise _compile_internal("torch._inductor.compile_fx.compile_fx", exc) from exc
    import torch._functorch.config as functorch_config

    # AOTAutograd's cache stores inductor's *whole-graph* output keyed without the inner compiler:
    # a hit would silently skip concur's placement of the kernels, so it stays off for this compile.
    patch = {"enable_autograd_cache": False} if hasattr(functorch_config, "enable_autograd_cache") else {}
    with functorch_config.patch(patch):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def inductor_compile_graph(gm: torch.fx.GraphModule, example_inputs: list, *args, **kwargs) -> object:
    """Compile one aten graph to fused kernels with inductor (``compile_fx_inner``)."""
    try:
        from torch._inductor.compile_fx import compile_fx_inner
    except ImportError as exc:  # pragma: no cover
        raise _compile_internal("torch._inductor.compile_fx.compile_fx_inner", exc) from exc
    return compile_fx_inner(gm, example_inputs, *args, **kwargs)


def outside_fake_mode() -> contextlib.AbstractContextManager:
    """Return a context in which tensors are real even inside a compile (AOTAutograd's fake mode is off).

    Inductor compiles a forward graph while AOTAutograd's ``FakeTensorMode``
    is active; timing its output needs real inputs and real kernels
    (``torch._subclasses.fake_tensor.unset_fake_temporarily``).
    """
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError as exc:  # pragma: no cover - depends on torch version
        raise RuntimeError(f"torch {torch.__version__} has no torch._subclasses.fake_tensor."
                           f"unset_fake_temporarily ({exc})") from exc
    return unset_fake_temporarily()


def aot_autograd_backend(fw_compiler, bw_compiler) -> object:
    """Return a dynamo backend running AOTAutograd with the given forward/backward compilers."""
    try:
        from torch._dynamo.backends.common import aot_autograd
    except ImportError as exc:  # pragma: no cover
        raise _compile_internal("torch._dynamo.backends.common.aot_autograd", exc) from exc
    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)


@contextlib.contextmanager
def inductor_buffer_reuse(enabled: bool) -> Iterator[None]:
    """Let inductor's generated code put a new buffer in a dead one's memory (its default), or not.

    A reused buffer ties the kernel that writes the new buffer to every kernel
    that read the old one: an order the dataflow does not need, which chains
    independent branches together once their launches go on separate streams.
    """
    try:
        from torch._inductor import config
        config.allow_buffer_reuse  # noqa: B018 - the setting must exist in this version
    except (ImportError, AttributeError) as exc:  # pragma: no cover
        raise _compile_internal("torch._inductor.config.allow_buffer_reuse", exc) from exc
    with config.patch(allow_buffer_reuse=enabled):
        yield


def _is_generated_call(fn: object) -> bool:
    raw = getattr(fn, "__func__", fn)
    return getattr(raw, "__name__", "") == "call" and "reinterpret_tensor" in getattr(raw, "__globals__", {})


def _generated_call_slot(compiled: object) -> tuple[object, Callable[[object], None]]:
    """Return inductor's generated ``call`` and a function that replaces it where the compiled graph calls it.

    ``current_callable`` is that ``call``, or a wrapper inductor put around it
    (``align_inputs_from_check_idxs`` copies misaligned inputs, then calls it
    from its closure); the wrapper is kept and only its inner call replaced.
    """
    fn = getattr(compiled, "current_callable", None)
    if _is_generated_call(fn):
        return fn, lambda new: setattr(compiled, "current_callable", new)
    for _ in range(3):  # a few wrappers deep
        cells = getattr(getattr(fn, "__func__", fn), "__closure__", None) or ()
        callables = [c for c in cells if callable(getattr(c, "cell_contents", None))]
        inner = [c for c in callables if _is_generated_call(c.cell_contents)]
        if inner:
            cell = inner[0]
            return cell.cell_contents, lambda new: setattr(cell, "cell_contents", new)
        if len(callables) != 1:
            break
        fn = callables[0].cell_contents
    raw = getattr(fn, "__func__", fn)
    raise ValueError(f"inductor's output calls {getattr(raw, '__name__', type(fn).__name__)!r}, and no generated "
                     "call function was found inside it")


def inductor_wrapper(compiled: object) -> tuple[str, dict, object | None, Callable[[object], None]]:
    """Return (module source, module globals, bound ``self`` or None, replace) of a compiled graph's ``call``.

    ``compiled`` is what ``compile_fx_inner`` returns (a ``CompiledFxGraph``);
    ``replace(new_call)`` makes it run ``new_call`` (boxed: one list
    argument) in place of the generated one, inside any wrapper of inductor's.

    Raises:
        ValueError: no generated ``call`` was found (the graph then runs as inductor made it).
    """
    fn, replace = _generated_call_slot(compiled)
    raw = getattr(fn, "__func__", fn)
    namespace = raw.__globals__
    path = namespace.get("__file__")
    source = getattr(compiled, "source_code", None)
    if path and os.path.exists(path):
        with open(path) as f:
            source = f.read()
    if not source:
        raise ValueError("inductor's output keeps no source code")
    return source, namespace, getattr(fn, "__self__", None), replace


def compile_phase_seconds() -> dict[str, float]:
    """Seconds this process spent in each phase torch.compile times (dynamo, AOTAutograd, inductor, waits).

    From ``torch._dynamo.utils.compilation_time_metrics``; empty where a torch
    version lacks it. Phases nest, so they do not add up.
    """
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return {}
    return {name: float(sum(times)) for name, times in compilation_time_metrics.items()}


def register_dynamo_backend(name: str, compiler_fn) -> None:
    """Register ``compiler_fn`` under ``name`` for ``torch.compile(backend=name)`` (idempotent)."""
    from torch._dynamo import list_backends, register_backend

    if name not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=compiler_fn, name=name)


def has_symbolic_shapes(example_inputs: list) -> bool:
    """Return True if any example input is a SymInt or a tensor with symbolic sizes."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape):
            return True
    return False


# --- inductor's own streams (torch >= 2.13), used by concur.inductor.stamp ------------------
# torch 2.11 has none of it (only make_fallback of streams::record_event/wait_event); 2.13.0 and
# 2.14.1 have all of it. Each accessor checks the attributes it uses, not just the version.


def has_inductor_node_streams() -> bool:
    """Return True if inductor lowers ``node.meta["custom"]["stream"]`` into streams (torch >= 2.13).

    Checks the pieces concur's stamping pass relies on: the per-node stream
    read by ``GraphLowering``, the scheduler's stream assignment before
    fusion, the ``control_deps`` lowering that orders sync ops, the
    ``torch.ops.streams`` event ops, and dynamo's table of user objects.
    """
    if torch_version() < (2, 13):
        return False
    try:
        import torch._dynamo.variables.streams  # noqa: F401 - registers torch.ops.streams.*
        from torch._dynamo import graph_bytecode_inputs
        from torch._inductor.fx_passes import control_dependencies
        from torch._inductor.graph import GraphLowering
        from torch._inductor.scheduler import Scheduler
        from torch._inductor import lowering

        return (hasattr(GraphLowering, "_get_node_stream")
                and hasattr(Scheduler, "_populate_stream_assignments")
                and hasattr(control_dependencies, "_create_subgraph_for_node")
                and hasattr(control_dependencies, "get_subgraph_name")
                and control_dependencies.control_deps in lowering.lowerings
                and isinstance(getattr(graph_bytecode_inputs, "index_to_external_object_weakref", None), dict)
                and all(hasattr(torch.ops.streams, op) for op in ("record_event", "wait_event", "record_stream")))
    except (ImportError, AttributeError, RuntimeError):
        return False


def inductor_reuses_within_streams_only() -> bool:
    """Return True if inductor keys its buffer reuse by stream, so a stamped graph reuses within a stream only.

    torch 2.14.1's ``codegen.wrapper.buffer_reuse_key`` puts the buffer's
    stream (``Scheduler.get_buf_stream``) in the key. Read from its source,
    so a torch that drops it reads as False and concur turns reuse off.
    """
    if not has_inductor_node_streams():
        return False
    try:
        import inspect

        from torch._inductor.codegen import wrapper

        return "get_buf_stream" in inspect.getsource(wrapper.buffer_reuse_key)
    except (ImportError, AttributeError, OSError, TypeError):
        return False


@dataclasses.dataclass(frozen=True)
class InductorStreamOps:
    """The ops and helpers a pass needs to put stream syncs in an aten graph inductor will lower."""

    record_event: object
    wait_event: object
    record_stream: object
    control_deps: object
    sync_ops: tuple
    create_subgraph_for_node: Callable
    get_subgraph_name: Callable


def inductor_stream_ops() -> InductorStreamOps:
    """Return ``torch.ops.streams`` event ops, ``control_deps`` and its subgraph helpers.

    Raises:
        RuntimeError: this torch has no inductor streams (see :func:`has_inductor_node_streams`).
    """
    if not has_inductor_node_streams():
        raise RuntimeError(f"torch {torch.__version__} has no inductor node streams (needs torch >= 2.13)")
    from torch._inductor.fx_passes import control_dependencies as cd

    ops = torch.ops.streams
    sync = tuple(getattr(ops, name).default for name in
                 ("record_event", "wait_event", "wait_stream", "synchronize_event", "synchronize_stream",
                  "synchronize_device", "record_stream", "sync_dealloc", "fork", "join") if hasattr(ops, name))
    return InductorStreamOps(ops.record_event.default, ops.wait_event.default, ops.record_stream.default,
                             cd.control_deps, sync, cd._create_subgraph_for_node, cd.get_subgraph_name)


def external_object_table() -> dict:
    """Return dynamo's table of user objects (index -> weakref) that inductor's stream code reads.

    ``torch._dynamo.graph_bytecode_inputs.index_to_external_object_weakref``:
    the generated wrapper calls ``_get_stream_by_index(i)`` on it, and dynamo
    clears and refills it (in place) when a frame with user streams starts.
    """
    from torch._dynamo import graph_bytecode_inputs

    table = getattr(graph_bytecode_inputs, "index_to_external_object_weakref", None)
    if not isinstance(table, dict):
        raise RuntimeError(f"torch {torch.__version__} has no dynamo user-object table")
    return table


def device_has_streams(device: torch.device) -> bool:
    """Return True if inductor emits stream contexts for this device type (its ``device_need_guard``)."""
    try:
        from torch._inductor.utils import device_need_guard
    except ImportError:  # pragma: no cover
        return device.type == "cuda"
    return bool(device_need_guard(device.type))


def custom_graph_pass_base() -> type:
    """Return inductor's ``CustomGraphPass`` (a pass with a ``uuid`` the FX graph cache keys on)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError as exc:  # pragma: no cover
        raise _compile_internal("torch._inductor.custom_graph_pass.CustomGraphPass", exc) from exc
    return CustomGraphPass


def hash_for_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    """Return inductor's hash of some source files and a string (``get_hash_for_files``), for a pass's uuid."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(paths, extra)


@contextlib.contextmanager
def post_grad_custom_post_pass(custom_pass: object) -> Iterator[None]:
    """Run ``custom_pass`` last among inductor's post-grad passes, after any the user set."""
    from torch._inductor import config

    existing = config.post_grad_custom_post_pass
    passes = () if existing is None else tuple(existing) if isinstance(existing, (list, tuple)) else (existing,)
    with config.patch(post_grad_custom_post_pass=[*passes, custom_pass]):
        yield


@contextlib.contextmanager
def inductor_peak_memory_reordering(enabled: bool) -> Iterator[None]:
    """Let inductor's scheduler reorder nodes to lower peak memory (``reorder_for_peak_memory``), or not.

    On, it may issue a stream's consumer before another branch's first kernel
    (seen on CPU with torch 2.14.1); off, it keeps the fx graph's order.
    A torch without the setting has no such reordering: nothing to patch.
    """
    from torch._inductor import config

    if not hasattr(config, "reorder_for_peak_memory"):
        yield
        return
    with config.patch(reorder_for_peak_memory=enabled):
        yield


def inductor_stream_names(num_streams: int) -> list[str]:
    """Return the names inductor's wrapper gives streams 0 .. num_streams-1 (``default_stream``, ``stream1``...)."""
    from torch._inductor.stream_constants import DEFAULT_STREAM, STREAM_NAME_TEMPLATE

    return [DEFAULT_STREAM] + [STREAM_NAME_TEMPLATE.format(stream_idx=i) for i in range(1, num_streams)]


def bind_wrapper_names(compiled: object, names: dict) -> None:
    """Define names in the module of a compiled graph's generated ``call`` (where it looks up globals).

    Raises:
        ValueError: no generated call was found (see :func:`inductor_wrapper`).
    """
    _, namespace, _, _ = inductor_wrapper(compiled)
    namespace.update(names)


def inductor_source_name(node: torch.fx.Node) -> str:
    """Return the name inductor lists for ``node`` in the "Source Nodes" comment above a kernel's launch.

    Inductor names a node by the first entry of its ``meta["from_node"]`` (in
    a forward graph, the node of dynamo's graph it was traced from, e.g.
    ``input_1`` for an ``addmm``); a node without one (the backward's) by its own
    name.
    """
    sources = node.meta.get("from_node")
    name = getattr(sources[0], "name", None) if isinstance(sources, (list, tuple)) and sources else None
    return name if isinstance(name, str) else node.name


# --- GradScaler and fused optimizers, used by concur.training.step -----------------------------------


def grad_scaler_tensors(scaler: "torch.amp.GradScaler") -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return GradScaler's loss scale and growth tracker: its whole mutable state between steps.

    Both are private attributes (``_scale``, ``_growth_tracker``), created
    lazily by the first ``scale()`` call; None until then.
    """
    return getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)


def reset_grad_scaler(scaler: "torch.amp.GradScaler", scale: torch.Tensor | None,
                      growth_tracker: torch.Tensor | None) -> None:
    """Put GradScaler's tensors back in place: to saved copies, or to a fresh scaler's state if None."""
    live_scale, live_growth = grad_scaler_tensors(scaler)
    if live_scale is None:
        return
    if scale is None:
        live_scale.fill_(scaler._init_scale)
        live_growth.zero_()
    else:
        live_scale.copy_(scale)
        live_growth.copy_(growth_tracker)


def enable_device_side_amp_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``GradScaler.step`` hand the optimizer ``found_inf`` as a tensor; False if it cannot.

    Fused optimizers (SGD, Adam, AdamW with ``fused=True``) set the private
    flag ``_step_supports_amp_scaling`` and skip an overflowing step on the
    device; any optimizer whose groups have a ``fused`` option gets it here.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return True
    if not all("fused" in group and "foreach" in group for group in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True
    return True


def note_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell lr schedulers that the optimizer stepped when concur's captured update stood in for ``step()``.

    ``LRScheduler`` wraps ``optimizer.step`` to set the private flag
    ``_opt_called`` and warns on its first ``step()`` if it is unset
    ("Detected call of lr_scheduler.step() before optimizer.step()").
    """
    optimizer._opt_called = True


# --- Module calls and saved tensors, read by concur.fx.weight_grads --------------------------------

_LOCAL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def module_call_runs_more_than_forward(module: torch.nn.Module) -> bool:
    """Return True if ``module(x)`` would do more than ``forward(x)``: hooks (its own or global), or a compiled call.

    Reads the private dictionaries ``nn.Module._call_impl`` checks for its
    fast path (stable since torch 2.0). A name this torch lacks counts as a
    hook: whoever asks then keeps the plain module call.
    """
    from torch.nn.modules import module as module_mod

    try:
        own = any(getattr(module, name) for name in _LOCAL_HOOKS)
        everyone = any(getattr(module_mod, name) for name in _GLOBAL_HOOKS)
    except AttributeError:  # pragma: no cover - depends on torch version
        return True
    return own or everyone or module.__dict__.get("_compiled_call_impl") is not None


def saved_tensors_hooks_active() -> bool:
    """Return True if saved-tensor hooks (``saved_tensors_hooks``, ``save_on_cpu``, checkpointing) are active.

    Asks the private ``torch._C._autograd._top_saved_tensors_default_hooks``,
    which torch's own checkpointing asks too; if this torch lacks it, hooks
    count as active.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - depends on torch version
        return True
    return top(False) is not None


# --- The captured optimizer update (concur.training.captured_optim) ---------------------------------

def _fused_sgd_tensor_lr() -> Callable | None:
    """aten's ``_fused_sgd_.tensor_lr`` overload (torch >= 2.4), or None where this torch lacks it."""
    op = getattr(torch.ops.aten, "_fused_sgd_", None)
    return getattr(op, "tensor_lr", None) if op is not None else None


def foreach_axpy_(xs: list[torch.Tensor], ys: list[torch.Tensor], scale: torch.Tensor, add: bool) -> None:
    """``x += scale * y`` (``add``) or ``x -= scale * y`` for each pair, ``scale`` a 0-dim device tensor.

    torch's foreach ops take a device scalar only as a multiplier of one list
    (``_foreach_mul``), so ``x += s*y`` would allocate ``s*y`` for every
    parameter. aten's fused SGD with momentum 0 and a tensor ``lr`` is exactly
    ``x -= lr*y`` in one multi-tensor kernel without a temporary (its CUDA
    kernel reads ``lr`` as float32, hence ``scale``'s dtype there; on the CPU it
    reads the value on the host). Without that overload, or for float64 on
    CUDA (where a float32 scale would round), it falls back to the temporary.
    """
    fused = _fused_sgd_tensor_lr()
    if fused is None or (xs[0].is_cuda and (scale.dtype != torch.float32 or xs[0].dtype == torch.float64)):
        scaled = torch._foreach_mul(ys, scale.to(xs[0].dtype))
        (torch._foreach_add_ if add else torch._foreach_sub_)(xs, scaled)
        return
    fused(xs, ys, [], weight_decay=0.0, momentum=0.0, lr=scale, dampening=0.0, nesterov=False, maximize=add,
          is_first_step=False)

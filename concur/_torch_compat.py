"""The one place that touches private or version-dependent PyTorch APIs.

Everything here is checked against the installed torch version, so that a
future release that moves an internal breaks one small function with a clear
message instead of a silent wrong result somewhere deep in concur.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import warnings
import weakref
from typing import Callable, Iterator, Mapping

import torch

MIN_TORCH = (2, 4)
# The torch.compile backend reads inductor's generated code, which no release promises to keep:
# these (major, minor) releases are the ones it was tested on: 2.11 on the H100 (the GPU tests,
# golden CUDA wrappers), 2.13, 2.14 and 2.15 on the CPU (the tests, golden CPU wrappers, and golden
# CUDA wrappers generated without a GPU). A set, not a range: a release between two tested ones
# (2.12) was never tested either. On any other release it warns once and relies on failing closed.
TESTED_TORCH = frozenset({(2, 11), (2, 13), (2, 14), (2, 15)})


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
# Tested on the releases in TESTED_TORCH. Each accessor imports lazily so that `import concur` never
# pays for (or breaks on) inductor.

_warned_untested: list[tuple[int, int]] = []  # the version warned about, once per process


def tested_torch_versions() -> str:
    """Return the releases in :data:`TESTED_TORCH` as text, oldest first ("2.11, 2.13, 2.14 and 2.15")."""
    names = [f"{major}.{minor}" for major, minor in sorted(TESTED_TORCH)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def untested_torch() -> str | None:
    """Return why the installed torch is not in :data:`TESTED_TORCH` for the compile backend, or None."""
    if torch_version() in TESTED_TORCH:
        return None
    return (f"torch {torch.__version__} is not one of the releases concur's torch.compile backend was tested on "
            f"({tested_torch_versions()}): inductor's generated code may have changed, so every "
            "graph whose wrapper concur does not fully read runs as plain inductor output (with a warning)")


def warn_if_untested_torch() -> None:
    """Warn once per process if the installed torch is not in :data:`TESTED_TORCH`."""
    reason = untested_torch()
    if reason is not None and not _warned_untested:
        _warned_untested.append(torch_version())
        warnings.warn(f"concur backend: {reason}", stacklevel=3)

def _compile_internal(what: str, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"concur's torch.compile backend needs {what}, which torch {torch.__version__} does not "
        f"provide ({type(exc).__name__}: {exc}). It is tested on torch {tested_torch_versions()}; "
        "use backend='inductor' or concur.train_step(compile=False) on this version.")


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


# The caching allocator's option (torch >= 2.9, pytorch/pytorch#158352) to reuse, during a CUDA-graph capture,
# a block freed while other streams may still use it (``record_stream``) as soon as the graph's own
# dependencies order those uses before the next allocation, instead of holding it until the capture ends.
_RECORD_STREAM_REUSE = "graph_capture_record_stream_reuse"


def _alloc_conf() -> str:
    """The user's allocator configuration: both environment variables, joined."""
    return ",".join(os.environ.get(var, "") for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))


def _alloc_conf_names(key: str) -> bool:
    """Whether the user's allocator configuration (either environment variable) sets ``key``."""
    return key in _alloc_conf()


def _record_stream_reuse_setter() -> Callable[[str], None] | None:
    """The allocator's settings setter, where this torch and its allocator backend know the option; else None."""
    # torch >= 2.10 names the setter per accelerator, and warns on the older CUDA name
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)
    if setter is None or torch_version() < (2, 9):
        return None
    try:
        return setter if torch.cuda.get_allocator_backend() == "native" else None
    except (RuntimeError, AssertionError):  # no CUDA here: nothing is captured
        return None


@contextlib.contextmanager
def capture_reuses_cross_stream_blocks() -> Iterator[None]:
    """Inside the block, a CUDA-graph capture reuses the memory of dead buffers other streams read.

    A multi-stream plan protects each buffer a side stream reads with
    ``record_stream``. During a capture the allocator cannot query events, so
    by default every such buffer freed in it stays held until the capture
    ends, where one stream would reuse it. With the option on, the allocator
    reuses a block once the captured graph orders its readers before the new
    writer, so a multi-stream step holds less. It is switched on for the block only, and left
    alone where the user's allocator configuration names it, under another
    allocator backend, or where this torch does not know it (nothing changes).
    """
    setter = _record_stream_reuse_setter()
    if setter is None or _alloc_conf_names(_RECORD_STREAM_REUSE):
        yield
        return
    try:
        setter(f"{_RECORD_STREAM_REUSE}:True")
    except (RuntimeError, ValueError):  # an allocator without the option: captures hold such blocks, as before
        yield
        return
    try:
        yield
    finally:
        setter(f"{_RECORD_STREAM_REUSE}:False")


def captures_reuse_cross_stream_blocks() -> bool:
    """Whether captures inside :func:`capture_reuses_cross_stream_blocks` reuse a dead block other streams used.

    True where that function switches the option on, or the user's allocator
    configuration does (``graph_capture_record_stream_reuse:True``); False
    where the configuration turns it off, under another allocator backend,
    or on a torch without the option. Without it, every buffer a side stream
    used and the caller's stream allocated stays held to the end of a
    capture, so a plan that allocates on the caller's stream would hold more.
    """
    conf = _alloc_conf()
    if _RECORD_STREAM_REUSE in conf:
        return f"{_RECORD_STREAM_REUSE}:true" in conf.replace(" ", "").lower()
    return _record_stream_reuse_setter() is not None


def finish_failed_capture(device: int, pool: object) -> bool:
    """Undo what a failed CUDA-graph capture left in ``pool``; return whether it had left anything.

    Call it once the failed graph object is gone. A capture the driver
    invalidated (a block freed with ``cudaFree`` while the stream captured,
    as the caching allocator does when a capture runs out of memory; a graph
    destroyed mid-capture) makes ``CUDAGraph.capture_end`` raise before it
    ends the allocator's recording into the pool. Then every later capture
    into the pool fails with "beginAllocateToPool: already recording to
    mempool_id", and the pool's memory stays reserved for good: the graph
    never held it by torch's reckoning, so it never gives it back.

    Where the recording is still on once the graph is gone, torch did not
    clean up: the recording is ended and the graph's hold on the pool given
    back (its segments go back to the device at the next ``empty_cache``
    where no live graph shares the pool). Where torch cleaned up itself
    (releases whose graph undoes an abandoned capture), nothing is done: it
    is never undone twice. A torch without these calls changes nothing
    (False); the caller captures into a new pool either way.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None or pool is None:
        return False
    try:
        end(device, pool)
    except (RuntimeError, TypeError):  # not recording into it: torch ended the capture, or it never began
        return False
    try:
        release(device, pool)
    except (RuntimeError, TypeError):
        pass
    return True


def end_generator_capture(stream: "torch.cuda.Stream") -> None:
    """Take the device's random-number generator out of capture mode after a capture that failed.

    On releases that keep a capture flag in the generator, ``capture_end``
    raising before its end (an invalidated capture) leaves the flag on, and
    every random op after it fails with "Offset increment outside graph
    capture encountered unexpectedly". An empty capture on ``stream`` (not
    the default stream) begins and ends one, which turns the flag off; on
    releases that keep capture state per capture it changes nothing.
    """
    try:
        with warnings.catch_warnings():  # "The CUDA Graph is empty": the point of this one
            warnings.simplefilter("ignore")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin()
                graph.capture_end()
            del graph
    except (RuntimeError, AttributeError):  # a torch without these calls, or no CUDA: nothing to end
        pass


def clear_cublas_workspaces() -> None:
    """Give back the cuBLAS workspaces torch keeps per handle and stream (held for the life of the process
    otherwise), as inductor's graph trees do before they capture. Only while no captured graph lives: a graph
    replays into the workspace it captured with. Nothing happens where this torch has no such call."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


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


def inductor_generated_call(compiled: object) -> Callable[[list], object]:
    """Return the generated ``call`` a compiled graph runs now (boxed), inside any wrapper of inductor's.

    Calling it directly skips those wrappers (``align_inputs_from_check_idxs``
    copying misaligned inputs): right for a call installed in its place with
    :func:`inductor_wrapper`'s ``replace``, which gets the inputs the wrappers
    pass on.

    Raises:
        ValueError: no generated call was found (see :func:`inductor_wrapper`).
    """
    return _generated_call_slot(compiled)[0]


def inductor_mutated_inputs(compiled: object) -> frozenset[int] | None:
    """Return the positions of the inputs a compiled graph's call writes in place, or None where torch does not say.

    ``CompiledFxGraph.mutated_input_idxs`` (an ``OrderedSet`` of ints on
    each release in :data:`TESTED_TORCH`): the graph inputs inductor's scheduler saw mutated,
    the ones its CUDA graph trees copy back. A backward's donated buffers,
    which inductor may overwrite too, are not among them. On a release
    not in :data:`TESTED_TORCH`, or where the attribute is missing or holds
    anything but non-negative ints, this reads as None, and the caller
    leaves the inputs alone.
    """
    if untested_torch() is not None:
        return None
    idxs = getattr(compiled, "mutated_input_idxs", None)
    if idxs is None or isinstance(idxs, (str, bytes, dict)):
        return None
    try:
        found = frozenset(idxs)
    except TypeError:
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in found):
        return None
    return found


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


def has_symbolic_shapes(example_inputs: list) -> bool:
    """Return True if any example input is a SymInt or a tensor with symbolic sizes."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape):
            return True
    return False


# --- aten ops' schemas and FLOP formulas, read by dag.annotate, inductor.aten_dag, inductor.stamp, inductor.wrapper_parse ---


def is_op_overload(target: object) -> bool:
    """Return True if ``target`` is one overload of a registered op (``torch.ops.aten.add_.Tensor``)."""
    from torch._ops import OpOverload

    return isinstance(target, OpOverload)


def op_schema(target: object) -> "torch.FunctionSchema | None":
    """Return the schema of an op overload (its alias annotations say which arguments it writes), else None.

    ``OpOverload._schema`` is private; an overload without a readable schema
    raises rather than reading as "writes nothing".

    Raises:
        RuntimeError: ``target`` is an op overload whose schema this torch keeps elsewhere.
    """
    if not is_op_overload(target):
        return None
    schema = getattr(target, "_schema", None)
    if not isinstance(schema, torch.FunctionSchema):
        raise _compile_internal("the schema of each aten op (OpOverload._schema)",
                                AttributeError(f"{type(target).__name__} without a FunctionSchema"))
    return schema


def op_counts_no_flops(target: object) -> bool:
    """Return True where ``torch.utils.flop_counter.FlopCounterMode`` would count 0 FLOPs for op ``target``.

    The mode counts an op by the formula registered for its packet
    (``flop_registry``); an op without one it decomposes where the op has a
    ``CompositeImplicitAutograd`` kernel and counts the ops inside; anything
    else counts 0. Running an op on meta tensors costs more on the host than
    everything else the cost model does, so ops known to count 0 are not run.
    Anything this torch does not say for certain (not an op overload, no
    ``flop_registry``, no way to ask for the kernel) reads False: run it, as
    before.
    """
    if not is_op_overload(target):
        return False
    try:
        from torch.utils.flop_counter import flop_registry
        decomposes = target.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
    except (ImportError, AttributeError, RuntimeError):
        return False
    return target.overloadpacket not in flop_registry and not decomposes


# --- Memory formats, read by concur.inductor.backward_split ------------------------------------------


def _c10_strides_like_channels_last(sizes: torch.Size, strides: tuple[int, ...]) -> bool:
    """Return c10's ``is_channels_last_strides_2d_s4``: a 4-d tensor's strides ordered C <= W <= H <= N."""
    if strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def suggests_channels_last(t: torch.Tensor) -> bool:
    """Return whether ``t.suggest_memory_format()`` is channels-last (c10's reading of a 4-d tensor's strides).

    Read off the strides, not ``is_contiguous``: a 1x1 kernel's weight is
    contiguous in both formats, and cuDNN goes by its strides. The C++
    method is not bound in Python; torch's private Python copy,
    ``torch._prims_common.suggest_memory_format``, answers for fake and
    meta tensors too, and for symbolic sizes without adding a guard. It
    agrees with c10 on 2.11 and 2.13 to 2.15; earlier copies multiplied by
    a dimension's size where its *stride* exceeded 1 and disagreed on some
    views (fixed by pytorch#173038). So on a release not in :data:`TESTED_TORCH`,
    or where the function is missing, c10's rule as written out here answers.
    """
    if t.layout != torch.strided or t.dim() != 4:
        return False
    suggest = None
    if untested_torch() is None:
        try:
            from torch._prims_common import suggest_memory_format as suggest
        except ImportError:  # pragma: no cover - depends on torch version
            suggest = None
    if suggest is None:
        return _c10_strides_like_channels_last(t.shape, t.stride())
    return suggest(t) == torch.channels_last


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
                and isinstance(getattr(graph_bytecode_inputs, "index_to_external_object_weakref", None), (dict, list))
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


def external_object_table() -> dict | list:
    """Return dynamo's table of user objects (index -> weakref) that inductor's stream code reads.

    ``torch._dynamo.graph_bytecode_inputs.index_to_external_object_weakref``:
    the generated wrapper calls ``_get_stream_by_index(i)`` on it. Up to
    torch 2.14 a dict that dynamo clears and refills in place when a frame
    with user objects runs; from 2.15 a list, indexed from 0, that dynamo
    *replaces* then (so it is looked up again on every call here).
    """
    from torch._dynamo import graph_bytecode_inputs

    table = getattr(graph_bytecode_inputs, "index_to_external_object_weakref", None)
    if not isinstance(table, (dict, list)):
        raise RuntimeError(f"torch {torch.__version__} has no dynamo user-object table")
    return table


def _external_object(table: dict | list, index: int) -> object | None:
    ref = table.get(index) if isinstance(table, dict) else table[index] if index < len(table) else None
    return ref() if ref is not None else None


class _Gone:
    pass


# What a list table holds below concur's indices where dynamo has put nothing: a dead reference, which
# dynamo's lookup reports ("no longer alive") instead of handing out a wrong object.
_DEAD = weakref.ref(_Gone())


class ExternalObjects:
    """Objects at fixed indices of dynamo's table of user objects, where inductor's stream code fetches them.

    Up to torch 2.14 the table is a dict that dynamo clears in place when a
    frame with user objects runs: the objects are put in and stay, put back
    when the newest (``sentinel``, standing for all) is missing, so a call
    costs one lookup. From 2.15 it is a list, indexed from 0, that dynamo
    replaces then, and that AOTAutograd snapshots after each forward and
    writes back, index by index, before its backward, which fails on an
    index past the end of the list current then: so the objects are in it
    only while a graph runs (:meth:`installed`), after dynamo's own entries
    and padded with dead references, and taken out again after it.
    """

    def __init__(self) -> None:
        self.objects: dict[int, object] = {}
        self.sentinel: int | None = None
        self._slab: tuple[int, list] | None = None  # list tables: (first index, references from there on)

    def add(self, index: int, obj: object) -> None:
        """Keep ``obj`` at ``index`` (it becomes the sentinel: the newest entry)."""
        self.objects[index] = obj
        self.sentinel, self._slab = index, None

    @contextlib.contextmanager
    def installed(self, current: Mapping[int, object] = {}) -> Iterator[None]:
        """Have the objects, and ``current`` (index -> an object of this call), in the table while the block runs.

        Raises:
            RuntimeError: dynamo's own entries reach the indices (a list table longer than the lowest).
        """
        table = external_object_table()
        if isinstance(table, dict):
            if self.sentinel is not None and _external_object(table, self.sentinel) is not self.objects[self.sentinel]:
                table.update({index: weakref.ref(obj) for index, obj in self.objects.items()})
            table.update({index: weakref.ref(obj) for index, obj in current.items()})
            yield
            return
        indices = [*self.objects, *current]
        low, top, start = min(indices), max(indices) + 1, len(table)
        if start > low:
            raise RuntimeError(f"dynamo's table of user objects holds {start} objects, reaching concur's "
                               f"indices ({low} and up); torch {torch.__version__} may hand out more than "
                               "concur expects: use route='wrapper'")
        if self._slab is None or self._slab[0] != low or len(self._slab[1]) != top - low:
            refs = [_DEAD] * (top - low)
            for index, obj in self.objects.items():
                refs[index - low] = weakref.ref(obj)
            self._slab = (low, refs)
        slab = list(self._slab[1])
        for index, obj in current.items():
            slab[index - low] = weakref.ref(obj)
        table.extend([_DEAD] * (low - start))
        table.extend(slab)
        try:
            yield
        finally:
            del table[start:]


def mark_boxed(fn: object) -> None:
    """Mark a callable as taking inductor's boxed arguments (one list), as inductor's own compiled graphs do.

    AOTAutograd reads the private flag ``_boxed_call`` to decide how to call it.
    """
    fn._boxed_call = True


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
    """Return inductor's hash of some source files and a string (``get_hash_for_files``), for a pass's uuid.

    Where this torch lacks the helper, the same SHA-256 (of ``extra``, then
    each file's bytes) is computed here: the uuid only has to change when
    the files or ``extra`` do, so the FX graph cache behaves as before.
    """
    try:
        from torch._inductor.custom_graph_pass import get_hash_for_files
    except ImportError:
        get_hash_for_files = None
    if get_hash_for_files is not None:
        return get_hash_for_files(paths, extra)
    hasher = hashlib.sha256(extra.encode("utf-8"))
    for path in paths:
        with open(path, "rb") as f:
            hasher.update(f.read())
    return hasher.digest()


@contextlib.contextmanager
def post_grad_custom_post_pass(custom_pass: object) -> Iterator[None]:
    """Run ``custom_pass`` last among inductor's post-grad passes, after any the user set.

    Raises:
        RuntimeError: this torch has no ``post_grad_custom_post_pass`` setting (the stamped route's
            caller then compiles the graph without the pass, with a warning).
    """
    try:
        from torch._inductor import config

        existing = config.post_grad_custom_post_pass
    except (ImportError, AttributeError) as exc:
        raise _compile_internal("torch._inductor.config.post_grad_custom_post_pass", exc) from exc
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
    """Return the names inductor's wrapper gives streams 0 .. num_streams-1 (``default_stream``, ``stream1``...).

    Raises:
        RuntimeError: this torch keeps the names elsewhere (a guessed name would bind nothing the
            wrapper uses; the stamped route's caller compiles the graph without the pass, with a warning).
    """
    try:
        from torch._inductor.stream_constants import DEFAULT_STREAM, STREAM_NAME_TEMPLATE
    except ImportError as exc:
        raise _compile_internal("torch._inductor.stream_constants", exc) from exc
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


_SCALER_STATE = ("_scale", "_growth_tracker", "_init_scale")
_MISSING = object()


def grad_scaler_unreadable(scaler: "torch.amp.GradScaler") -> str | None:
    """Return why this torch's GradScaler state cannot be saved and put back by concur, or None if it can.

    An enabled scaler (``torch.amp.GradScaler.__init__``) holds ``_scale`` and
    ``_growth_tracker`` from its construction on: None until the first
    ``scale()``, then a tensor each; and ``_init_scale``, what a fresh one
    starts from. A disabled scaler holds no state, so none is missing.
    """
    if not scaler.is_enabled():
        return None
    found = {name: getattr(scaler, name, _MISSING) for name in _SCALER_STATE}
    missing = [name for name, value in found.items() if value is _MISSING]
    if missing:
        return f"torch {torch.__version__}'s GradScaler has no {', '.join(missing)}"
    scale, growth = found["_scale"], found["_growth_tracker"]
    if (scale is None) != (growth is None) or \
            not all(t is None or isinstance(t, torch.Tensor) for t in (scale, growth)):
        return (f"torch {torch.__version__}'s GradScaler holds {type(scale).__name__} and {type(growth).__name__} "
                "in _scale and _growth_tracker, not two tensors (or two Nones before the first scale())")
    return None


def grad_scaler_tensors(scaler: "torch.amp.GradScaler") -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return GradScaler's loss scale and growth tracker: its whole mutable state between steps.

    Both are private attributes (``_scale``, ``_growth_tracker``), created
    lazily by the first ``scale()`` call; None until then, and for a
    disabled scaler, which has no state.

    Raises:
        RuntimeError: this torch keeps the state elsewhere (:func:`grad_scaler_unreadable`), so that a
            restore never silently puts nothing back.
    """
    reason = grad_scaler_unreadable(scaler)
    if reason is not None:
        raise RuntimeError(f"concur cannot save and put back the loss scale: {reason}; use "
                           "concur.train_step(cuda_graph=False) with a GradScaler on this torch")
    if not scaler.is_enabled():
        return None, None
    return scaler._scale, scaler._growth_tracker


def reset_grad_scaler(scaler: "torch.amp.GradScaler", scale: torch.Tensor | None,
                      growth_tracker: torch.Tensor | None) -> None:
    """Put GradScaler's tensors back in place: to saved copies, or to a fresh scaler's state if None.

    Raises:
        RuntimeError: this torch keeps the state elsewhere (see :func:`grad_scaler_tensors`).
    """
    live_scale, live_growth = grad_scaler_tensors(scaler)
    if live_scale is None:  # still before the first scale(), or disabled: nothing to put back
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
    device; any optimizer whose groups have a ``fused`` option gets it here,
    with one warning (it changes the user's optimizer and its rounding).
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return True
    if not all("fused" in group and "foreach" in group for group in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True
    warnings.warn(f"concur.train_step: {type(optimizer).__name__} under GradScaler was switched to fused=True "
                  "(foreach=False), so that GradScaler hands it found_inf on the device and the CUDA graph skips "
                  "an overflowing step without asking the host; fused kernels may round differently from foreach "
                  "ones. Create the optimizer with fused=True to choose this yourself (and silence this warning).",
                  stacklevel=4)
    return True


def note_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell lr schedulers that the optimizer stepped when concur's captured update stood in for ``step()``.

    ``LRScheduler`` wraps ``optimizer.step`` to set the private flag
    ``_opt_called`` and warns on its first ``step()`` if it is unset
    ("Detected call of lr_scheduler.step() before optimizer.step()").
    """
    optimizer._opt_called = True


def optimizer_has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Return True if ``optimizer.step()`` would run hooks: the optimizer's own or every optimizer's (global ones).

    Reads the private dicts ``Optimizer.step``'s wrapper runs
    (``_optimizer_step_pre_hooks`` ... ``_global_optimizer_post_hooks``); where
    this torch keeps them elsewhere, it answers True, so the caller keeps
    ``optimizer.step()``.
    """
    from torch.optim import optimizer as optim_module

    own = (getattr(optimizer, "_optimizer_step_pre_hooks", None), getattr(optimizer, "_optimizer_step_post_hooks", None))
    shared = (getattr(optim_module, "_global_optimizer_pre_hooks", None),
              getattr(optim_module, "_global_optimizer_post_hooks", None))
    if any(h is None for h in own + shared):
        return True
    return any(len(h) for h in own + shared)


def step_replaced_on_instance(optimizer: torch.optim.Optimizer) -> bool:
    """Return True if ``optimizer.step`` was replaced on the instance by anything but an lr scheduler's wrapper.

    LR schedulers wrap the instance's ``step`` to note that it was called,
    marking the wrapper ``_wrapped_by_lr_sched`` (older torch:
    ``_with_counter``); any other replacement counts.
    """
    step = optimizer.__dict__.get("step")
    return step is not None and not any(hasattr(step, a) for a in ("_wrapped_by_lr_sched", "_with_counter"))


# --- nn.Module's own state, shared by concur.fx.module.ConcurModule with the model it wraps -----------

# The dicts nn.Module keeps submodules, parameters, buffers and state-dict hooks in: a ConcurModule holds
# the same dict objects as its model, so a change through either object is seen by both.
MODULE_SHARED_STATE = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_state_dict_hooks",
                       "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
# What ``module.compile()`` puts on an instance: a compiled call bound to that object, never copied.
MODULE_COMPILED_CALL = "_compiled_call_impl"
# What nn.Module's state_dict and load_state_dict call on every submodule (and its format version).
_STATE_DICT_PROTOCOL = ("_version", "_save_to_state_dict", "_load_from_state_dict")


def share_module_state(view: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make ``view`` hold ``model``'s own submodule, parameter, buffer and state-dict-hook dicts (the same objects).

    Raises:
        RuntimeError: this torch keeps a module's state in other attributes (nothing is shared).
    """
    missing = [name for name in MODULE_SHARED_STATE if not isinstance(vars(model).get(name), (dict, set))]
    missing += [name for name in _STATE_DICT_PROTOCOL if not hasattr(torch.nn.Module, name)]
    if missing:
        raise RuntimeError(f"concur.optimize shares the model's own state with the module it returns, and torch "
                           f"{torch.__version__} keeps it elsewhere (no {missing} on nn.Module); use the model "
                           "as it is, or fallback='eager'")
    for name in MODULE_SHARED_STATE:
        object.__setattr__(view, name, getattr(model, name))


class StateDictOfOriginal:
    """nn.Module's private state-dict protocol, answered by ``self.original`` (a mixin listed before nn.Module).

    ``state_dict`` and ``load_state_dict`` call ``_save_to_state_dict`` and
    ``_load_from_state_dict`` on every submodule and record its ``_version``:
    a wrapper that shares its model's state (:func:`share_module_state`)
    answers with its model's own, extra state included.
    """

    original: torch.nn.Module

    @property
    def _version(self) -> int:
        return self.original._version

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.original._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self.original._load_from_state_dict(*args, **kwargs)


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


def foreach_lerp_(xs: list[torch.Tensor], ys: list[torch.Tensor], weight: torch.Tensor, negate: bool) -> None:
    """``x += weight * (y - x)`` for each pair (``-y`` for ``y`` with ``negate``), ``weight`` a 0-dim device tensor.

    torch's ``_foreach_lerp_`` reads its weight as a host number (a tensor
    weight is read with ``.item()``, which a CUDA graph cannot capture). aten's
    fused SGD with momentum 0, weight decay 1 and a tensor ``lr`` computes
    ``x - lr*(x - y)`` (``x - lr*(x + y)`` without ``maximize``) in one
    multi-tensor kernel, which is lerp's ``x + w*(y - x)`` to the bit on the
    CPU (a negation and an exact multiply by 1 apart). Where
    :func:`foreach_axpy_` falls back, so does this, to three ops on a
    temporary ``y - x``.
    """
    fused = _fused_sgd_tensor_lr()
    if fused is None or (xs[0].is_cuda and (weight.dtype != torch.float32 or xs[0].dtype == torch.float64)):
        diff = torch._foreach_add(ys, xs) if negate else torch._foreach_sub(ys, xs)
        torch._foreach_mul_(diff, weight.to(xs[0].dtype))
        (torch._foreach_sub_ if negate else torch._foreach_add_)(xs, diff)
        return
    fused(xs, ys, [], weight_decay=1.0, momentum=0.0, lr=weight, dampening=0.0, nesterov=False, maximize=not negate,
          is_first_step=False)


def dispatch_mode_base() -> type | None:
    """Return torch's ``TorchDispatchMode`` (private: ``torch.utils._python_dispatch``), or None where this torch
    has none; a mode of it sees every aten call below autograd (:mod:`concur.caller_memory`)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return TorchDispatchMode


def cudnn_convolution_format(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: list,
                             padding: list, dilation: list, transposed: bool, output_padding: list,
                             groups: int) -> torch.memory_format | None:
    """Return the memory format of the output ``aten.convolution`` makes where it runs this call on cuDNN; None
    where it would run it on another backend, or this torch cannot say (``torch._C._select_conv_backend``,
    private): the call then runs as it is."""
    try:
        backend = torch._C._select_conv_backend(x, w, bias, stride, padding, dilation, transposed,
                                                output_padding, groups, None)
        if backend != torch._C._ConvBackend.Cudnn:
            return None
        return torch._C._conv_determine_backend_memory_format(x, w, backend)
    except (AttributeError, RuntimeError, TypeError):
        return None

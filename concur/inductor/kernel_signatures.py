"""Which pointers a compiled kernel writes, which it only stores to, and their element types.

To put inductor's launches on several streams, :mod:`concur.inductor.wrapper_parse`
must know which buffers each launch may write and which it never reads. Those
facts live in the kernels, not in the wrapper's ``call``: this module reads the
source inductor generates for each kernel it compiles at the wrapper's top
level (``async_compile.triton(...)``, ``async_compile.cpp_pybinding(...)``)
into a :class:`KernelSignature`.

It fails closed. A triton pointer counts as read-only only when the body
provably just loads through it, and as only stored to only when every use is
the address of a ``tl.store``; a C++ pointer is read-only only when it points
to ``const`` and only stored to in inductor's two store shapes; an element
type is given only where inductor's spelling names one torch dtype. A kernel
this module cannot read gets no signature, and its launches stay barriers.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch

from concur.inductor.syntax import subnodes

# the allocators inductor's wrapper calls for a buffer on each device
_ALLOCATORS = {"empty_strided_cuda", "empty_strided_cpu", "empty_strided_xpu", "empty_strided",
               "empty_strided_p2p"}
_COPYABLE_ALLOCATORS = _ALLOCATORS - {"empty_strided_p2p"}  # symmetric memory is not a private allocation


def _dotted(node: ast.AST) -> str | None:
    """Return ``a.b.c`` for a name or a chain of attributes on one, or None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


@dataclass(frozen=True)
class KernelSignature:
    """Parameter names of a compiled kernel, which of them it writes, and which it provably only stores to."""

    params: tuple[str, ...]
    written: frozenset[str]
    # pointers the kernel never reads through (a subset of ``written``): what it leaves there does not
    # depend on what the memory held before, so a buffer passed there may be a fresh allocation
    stores_only: frozenset[str] = frozenset()
    # pointer parameter -> the element type the kernel declares for it (triton_meta's signature, the C++
    # parameter types), for the names :data:`_TRITON_DTYPES` and :data:`_CPP_DTYPES` know; empty where the
    # launch's positional arguments might not map one to one onto ``params``
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    # the allocator of buffers on the kernel's device (``empty_strided_cuda`` for a triton kernel compiled
    # for cuda, ``empty_strided_cpu`` for a C++ one), or None where the wrapper does not say
    allocator: str | None = None


_MUTATED = re.compile(r"['\"]mutated_arg_names['\"]\s*:\s*\[([^\]]*)\]")
_TRITON_LOADS = {"tl.load"}  # the only uses of a pointer that cannot write through it
_TRITON_STORES = {"tl.store"}  # the only uses of a pointer that cannot read through it (atomics read)


def _triton_pointer_types(fn: ast.FunctionDef) -> dict[str, str]:
    """Return ``triton_meta['signature']`` (parameter -> triton type) from the kernel's decorator, if present."""
    for decorator in fn.decorator_list:
        if not isinstance(decorator, ast.Call):
            continue
        for keyword in decorator.keywords:
            if keyword.arg != "triton_meta" or not isinstance(keyword.value, ast.Dict):
                continue
            for key, value in zip(keyword.value.keys, keyword.value.values):
                if isinstance(key, ast.Constant) and key.value == "signature" and isinstance(value, ast.Dict):
                    return {str(k.value): str(v.value) for k, v in zip(value.keys, value.values)
                            if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


_TRITON_SCALARS = {"constexpr", "i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64",
                   "fp8e4nv", "fp8e5", "fp16", "bf16", "fp32", "fp64"}


# element types of kernel pointers as inductor spells them, each mapped to the one torch dtype spelled so;
# a name several dtypes share (triton's ``u8`` is also how float8_e8m0fnu and float4_e2m1fn_x2 are passed)
# or one not listed gives no type, and a buffer passed there no fresh allocation
_TRITON_DTYPES = {"i1": torch.bool, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
                  "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
_CPP_DTYPES = {"bool": torch.bool, "int8_t": torch.int8, "int16_t": torch.int16, "int32_t": torch.int32,
               "int64_t": torch.int64, "at::Half": torch.float16, "at::BFloat16": torch.bfloat16,
               "float": torch.float32, "double": torch.float64}


def _triton_pointer_dtype(triton_type: str) -> torch.dtype | None:
    """Return the element type of a triton signature's pointer type (``*bf16``), or None for anything else."""
    if not triton_type.startswith("*"):
        return None
    return _TRITON_DTYPES.get(triton_type[1:])


def _cpp_pointer_dtype(ctype: str) -> torch.dtype | None:
    """Return the element type of a C++ pointer parameter (``const at::BFloat16*``), or None for anything else."""
    text = " ".join(ctype.replace("__restrict__", " ").split())
    if text.count("*") != 1 or not text.endswith("*"):
        return None  # not a pointer, or a pointer to pointers, or a const pointer: not a form inductor writes
    pointee = " ".join(w for w in text[:-1].split() if w != "const")
    return _CPP_DTYPES.get(pointee)


def _triton_dtypes(fn: ast.FunctionDef, types: Mapping[str, str]) -> dict[str, torch.dtype]:
    """Return {pointer parameter: element type} of a triton kernel, or {} when its launches may skip a parameter.

    A launch passes its arguments by position to the parameters that are
    not ``tl.constexpr`` (the block sizes, set by the autotuner's config), so
    positions map one to one only when every constexpr comes after the rest.
    """
    constexpr = [_is_constexpr(a, types) for a in fn.args.args]
    if any(c and not later for c, later in zip(constexpr, constexpr[1:])):
        return {}
    found = {a.arg: _triton_pointer_dtype(types.get(a.arg, "")) for a in fn.args.args}
    return {param: dtype for param, dtype in found.items() if dtype is not None}


def _is_constexpr(arg: ast.arg, types: Mapping[str, str]) -> bool:
    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    return annotation.endswith("constexpr") or types.get(arg.arg) == "constexpr"


def _is_scalar_param(arg: ast.arg, types: Mapping[str, str]) -> bool:
    """A parameter the kernel cannot write through: a ``tl.constexpr``, or a scalar type in triton_meta.

    Only known scalar types count: a tensor descriptor (TMA) or a type this
    module has not seen is analysed like a pointer.
    """
    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    if annotation.endswith("constexpr"):
        return True
    return types.get(arg.arg) in _TRITON_SCALARS


@dataclass
class _KernelBody:
    """A triton kernel's body, walked once: each node's parent and the loaded names, grouped by name."""

    parents: dict[ast.AST, ast.AST]
    loads: dict[str, list[ast.Name]]

    @classmethod
    def of(cls, fn: ast.FunctionDef) -> "_KernelBody":
        parents: dict[ast.AST, ast.AST] = {}
        loads: dict[str, list[ast.Name]] = {}
        for statement in fn.body:  # not the decorators: their triton_meta is most of the source
            for parent in subnodes(statement):
                for field in parent._fields:
                    value = getattr(parent, field, None)
                    for child in value if isinstance(value, list) else (value,):
                        if isinstance(child, ast.AST):
                            parents[child] = parent
                if isinstance(parent, ast.Name) and isinstance(parent.ctx, ast.Load):
                    loads.setdefault(parent.id, []).append(parent)
        return cls(parents, loads)


def _only_loaded(body: _KernelBody, param: str) -> bool:
    """Whether every use of pointer ``param`` in the kernel body is the address of a ``tl.load``.

    The pointer may be offset (``in_ptr0 + x0``, ``A[:, None]``) and bound to
    locals on the way (``A = arg_A``; ``A += BLOCK_K``), which are followed.
    Any other use (``tl.store``, an atomic, a helper call such as
    ``triton_helpers.x_grid_barrier(sem_ptr)``, a block pointer, a
    comparison) is taken as a possible write: a write is assumed unless this
    function proves there is none.
    """
    return _only_addressed_by(body, param, _TRITON_LOADS)


def _only_stored(body: _KernelBody, param: str) -> bool:
    """Whether pointer ``param`` is used, and every use is the address of a ``tl.store``: never read.

    The mirror of :func:`_only_loaded`, with the same walk: a load, an
    atomic (which reads the old value), a helper call or anything else makes
    the pointer one the kernel may read.
    """
    return bool(body.loads.get(param)) and _only_addressed_by(body, param, _TRITON_STORES)


def _only_addressed_by(body: _KernelBody, param: str, calls: set[str]) -> bool:
    """Whether every use of pointer ``param`` (and of locals derived from it) is the address of one of ``calls``."""
    parents = body.parents
    derived, pending = {param}, [param]
    while pending:
        for name in body.loads.get(pending.pop(), ()):
            child, parent = name, parents.get(name)
            while isinstance(parent, ast.BinOp) or (isinstance(parent, ast.Subscript) and parent.value is child):
                child, parent = parent, parents.get(parent)
            if isinstance(parent, ast.Call) and _dotted(parent.func) in calls and (
                    (parent.args and parent.args[0] is child)
                    or any(k.arg == "pointer" and k.value is child for k in parent.keywords)):
                continue
            target = None
            if isinstance(parent, ast.Assign) and parent.value is child and len(parent.targets) == 1 \
                    and isinstance(parent.targets[0], ast.Name):
                target = parent.targets[0].id  # a local holding the pointer plus an offset
            elif isinstance(parent, ast.AugAssign) and parent.value is child and isinstance(parent.target, ast.Name):
                target = parent.target.id
            if target is not None:
                if target not in derived:
                    derived.add(target)
                    pending.append(target)
                continue
            if isinstance(parent, ast.Attribute) and parent.attr == "dtype" and parent.value is child:
                continue  # ``in_ptr0.dtype.element_ty``: metadata, no memory access
            return False
    return True


def _triton_signature(source: str, name: str | None = None) -> KernelSignature | None:
    """Parse a triton kernel's source; what it may write is established from its body.

    A pointer parameter counts as read-only only when :func:`_only_loaded`
    proves it; every other pointer (``out_ptr*``, ``in_out_ptr*``, but also
    ``sem_ptr``, ``ws_ptr`` or any name inductor adds later) counts as
    written. ``mutated_arg_names`` and the ``out_ptr`` / ``in_out_ptr`` names
    are added on top, so the body can only add writes, never remove them.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    named = [n for n in functions if n.name == name]
    jitted = [n for n in functions if any("jit" in (_dotted(d.func if isinstance(d, ast.Call) else d) or "")
                                          for d in n.decorator_list)]
    candidates = named or jitted or functions
    if len(candidates) != 1:
        return None  # which function is the kernel (and not a helper) is not clear: its launches stay barriers
    fn = candidates[0]
    params = tuple(a.arg for a in fn.args.args)
    if fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.posonlyargs:
        return None
    mutated = set()
    match = _MUTATED.search(source)
    if match:
        mutated = {m.strip().strip("'\"") for m in match.group(1).split(",") if m.strip()}
    types = _triton_pointer_types(fn)
    body = _KernelBody.of(fn)
    written = {p for p in params if p.startswith(("out_ptr", "in_out_ptr"))} | (mutated & set(params))
    pointers = [a.arg for a in fn.args.args if not _is_scalar_param(a, types)]
    written |= {p for p in pointers if not _only_loaded(body, p)}
    # a mutated argument is updated where the kernel writes, its old contents kept elsewhere: never "only stored"
    stores_only = {p for p in pointers if p in written and p not in mutated and not p.startswith("in_out_ptr")
                   and _only_stored(body, p)}
    return KernelSignature(params, frozenset(written), frozenset(stores_only), _triton_dtypes(fn, types))


_CPP_SCALARS = {"bool", "char", "int", "long", "float", "double", "int8_t", "int16_t", "int32_t", "int64_t",
                "uint8_t", "uint16_t", "uint32_t", "uint64_t", "size_t", "c10::BFloat16", "c10::Half",
                "bfloat16", "half", "at::BFloat16", "at::Half"}


def _cpp_param_written(ctype: str) -> bool:
    """Whether a C++ kernel parameter of type ``ctype`` may be written through.

    A pointer is read-only only when what it points to is ``const``
    (``const float*``, ``float const*``; ``float* const`` is a const pointer to
    writable floats); a by-value scalar cannot be written; any other type (a
    reference, a tensor, something unknown) counts as written.
    """
    text = " ".join(ctype.replace("__restrict__", " ").split())
    if "*" in text:
        pointee = text.split("*", 1)[0]
        return "const" not in pointee.split()
    if "&" in text:
        return True
    base = " ".join(w for w in text.split() if w not in ("const", "volatile"))
    return base not in _CPP_SCALARS


_CPP_KERNEL = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(([^)]*)\)\s*\{')
_CPP_IDENT = re.compile(r"[A-Za-z_]\w*")


def _cpp_stores_only(source: str, count: int) -> set[int]:
    """Return the positions of the C++ kernel's parameters that every use in its body only stores to.

    A use counts as a store only in the two shapes inductor's C++ backend
    writes: a vector store whose address starts with the pointer
    (``tmp3.store(out_ptr0 + x0)``, optionally with a count) and a scalar
    assignment starting a statement (``out_ptr0[x0] = tmp2;``, not ``+=``).
    Any other occurrence of the name (a load, ``auto in_ptr0 = in_out_ptr0``,
    a pointer handed to ``transpose_mxn`` or to an atomic, a comment) is
    taken as a possible read: a kernel group that stores a buffer and reads
    it back in a later loop never counts.
    """
    match = _CPP_KERNEL.search(source)
    if match is None:
        return set()
    declared = [p.strip() for p in match.group(1).split(",") if p.strip()]
    if len(declared) != count:
        return set()
    body = source[match.end():]
    found = set()
    for position, declaration in enumerate(declared):
        names = _CPP_IDENT.findall(declaration)
        if not names:
            continue
        uses = list(re.finditer(rf"\b{re.escape(names[-1])}\b", body))
        if uses and all(_cpp_is_store(body, m.start(), m.end()) for m in uses):
            found.add(position)
    return found


def _cpp_is_store(body: str, start: int, end: int) -> bool:
    """Whether the name at ``body[start:end]`` is the address of a store (see :func:`_cpp_stores_only`)."""
    before = body[:start].rstrip()
    after = body[end:].lstrip()
    if before.endswith(".store("):
        return after[:1] in ("+", ",", ")")
    if before[-1:] not in (";", "{", "}") or not after.startswith("["):
        return False
    depth = 0
    for i, char in enumerate(after):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth == 0:
            rest = after[i + 1:].lstrip()
            return rest.startswith("=") and not rest.startswith("==")
    return False


def kernel_signatures(module_source: str | ast.Module) -> dict[str, KernelSignature]:
    """Return the signature of every kernel the wrapper module (source, or its parsed tree) compiles."""
    tree = ast.parse(module_source) if isinstance(module_source, str) else module_source
    found: dict[str, KernelSignature] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)):
            continue
        name, call = node.targets[0].id, node.value
        how = call.func.attr
        if how == "triton" and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant):
            kernel = call.args[0].value if isinstance(call.args[0], ast.Constant) else None
            sig = _triton_signature(str(call.args[1].value), kernel if isinstance(kernel, str) else None)
            if sig is not None:
                device = next((k.value.value for k in call.keywords if k.arg == "device_str"
                               and isinstance(k.value, ast.Constant)), None)
                allocator = f"empty_strided_{device}" if isinstance(device, str) else None
                found[name] = replace(sig, allocator=allocator if allocator in _COPYABLE_ALLOCATORS else None)
        elif how == "cpp_pybinding" and call.args and isinstance(call.args[0], (ast.List, ast.Tuple)):
            if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in call.args[0].elts):
                continue  # types we cannot read: the launch stays a barrier
            types = [str(e.value) for e in call.args[0].elts]
            params = tuple(f"arg{i}" for i in range(len(types)))
            written = {p for p, t in zip(params, types) if _cpp_param_written(t)}
            source = call.args[1].value if len(call.args) > 1 and isinstance(call.args[1], ast.Constant) else None
            stored = _cpp_stores_only(source, len(types)) if isinstance(source, str) else set()
            stores_only = {params[i] for i in stored if params[i] in written}
            dtypes = {p: d for p, d in zip(params, map(_cpp_pointer_dtype, types)) if d is not None}
            found[name] = KernelSignature(params, frozenset(written), frozenset(stores_only), dtypes,
                                          "empty_strided_cpu")
    return found

"""Read inductor's generated wrapper as a program of kernel launches and the storages each touches.

After fusion, inductor emits one Python module per graph whose ``call``
function launches the fused kernels one after another on one stream::

    buf0 = empty_strided_cuda((8, 64, 28, 28), (50176, 1, 1792, 64), torch.float32)
    buf1 = extern_kernels.convolution(primals_3, primals_1, stride=(1, 1), ...)
    triton_poi_fused_relu_0.run(buf1, primals_2, buf0, 401408, stream=stream0)
    del buf1

This module turns that body into :class:`Statement` s, each with the storage
*groups* it reads and writes (a group is one allocation: ``buf9 = buf5  #
reuse`` and ``reinterpret_tensor(buf5, ...)`` stay in ``buf5``'s group), so
:mod:`concur.inductor.wrapper_emit` can issue the launches on several streams
without touching the kernels, their layouts or their fusion.

What a launch writes comes from the kernel itself
(:mod:`concur.inductor.kernel_signatures` reads it) and fails closed: a
triton pointer counts as read-only only when the kernel's body provably
just loads through it (``tl.load`` of the pointer plus offsets), so
``out_ptr*``, ``in_out_ptr*``, but also the cooperative reductions'
``sem_ptr`` and ``ws_ptr`` or any name inductor adds later count as
written; C++ kernels write every pointer to non-``const``; the known extern
kernels (convolution, mm, ...) write their ``out=``, any other every
argument; aten fallbacks follow their schema (``Tensor(a!)``), and ops
tagged ``nondeterministic_seeded`` also write the random generator, so
draws keep their order. A statement this module does not understand
becomes a *barrier* ordered after and before everything, which is slow but
never wrong.

Which reuse lines may give their new buffer storage of its own is
:mod:`concur.inductor.wrapper_reuse`'s. ``tests/test_golden_wrappers.py``
checks real wrappers of each version in :data:`TESTED_TORCH_VERSIONS`
against inductor's own scheduler.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Mapping

import torch

from concur import _torch_compat as compat
from concur.dag.annotate import RNG
from concur.inductor.kernel_signatures import _ALLOCATORS, KernelSignature, _dotted, kernel_signatures
from concur.inductor.wrapper_program import (_ALIGNING_COPIES, _EXTERN_OUT_ONLY, _HOST_CHECKS, _INPLACE_METHODS, _STREAM_GETTERS,
                                            _VIEWS, WORLD, KernelProgram, Reuse, Statement, UnsupportedWrapper,
                                            _bind_schema, _kernel_of, _names, _resolve, _stored)
from concur.inductor.wrapper_reuse import Storages, reuse_lines, splittable_reuses

__all__ = ["TESTED_TORCH_VERSIONS", "find_call_function", "parse_wrapper", "parse_wrapper_source", "source_namespace"]

# torch versions whose real wrappers are checked in (tests/fixtures/wrappers) and checked against inductor's
# own scheduler by tests/test_golden_wrappers.py: 2.11 on an H100 (triton); 2.13.0, 2.14.1 and 2.15.0 on CPU (C++),
# and their CUDA wrappers (triton) generated on the CPU with the device faked
TESTED_TORCH_VERSIONS = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")


# -- the call function -------------------------------------------------------------------------

def find_call_function(module_source: str | ast.Module) -> ast.FunctionDef:
    """Return the ``call`` function of a wrapper module (top level, or a method of its ``Runner``)."""
    tree = ast.parse(module_source) if isinstance(module_source, str) else module_source
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "call":
                    return item
    raise UnsupportedWrapper("the wrapper module has no call function")


def _schedulable_body(fn: ast.FunctionDef) -> tuple[list[ast.stmt], int, int]:
    """Return (statement list, start, end) of the region to reschedule."""
    guards = [s for s in fn.body if isinstance(s, ast.With)]
    if len(guards) > 1:
        raise UnsupportedWrapper(f"the call function has {len(guards)} device guards")
    if guards:
        body = guards[0].body
        start = 0
    else:
        body = fn.body
        clears = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                  and _dotted(s.value.func) == "args.clear"]
        start = clears[0] + 1 if clears else 0
    end = len(body)
    if end > start and isinstance(body[end - 1], ast.Return):
        end -= 1
    if any(isinstance(s, ast.Return) for s in body[start:end]):
        raise UnsupportedWrapper("a return statement in the middle of the call function")
    return body, start, end


def _inputs(fn: ast.FunctionDef) -> tuple[str, ...]:
    for s in fn.body:
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Name) and s.value.id == "args":
            target = s.targets[0]
            if isinstance(target, (ast.Tuple, ast.List)):
                return tuple(e.id for e in target.elts if isinstance(e, ast.Name))
            if isinstance(target, ast.Name):
                return (target.id,)
    return ()


def _outputs(fn: ast.FunctionDef) -> tuple[str, ...]:
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    return tuple(sorted(set().union(*(_names(r.value) for r in returns)))) if returns else ()


_ORIGINS = re.compile(r"#\s*Topologically Sorted Source Nodes:\s*\[([^\]]*)\]")


def listed_nodes(line: str) -> tuple[str, ...] | None:
    """Return the fx nodes a "Topologically Sorted Source Nodes" comment line lists, or None for any other line."""
    m = _ORIGINS.search(line)
    return tuple(x.strip() for x in m.group(1).split(",") if x.strip()) if m else None


def _attach_origins(statements: list["Statement"], lines: list[str]) -> None:
    """Give each launch the fx nodes of the last "Source Nodes" comment between it and the launch before.

    Inductor writes the comment above a kernel's launch, sometimes with the
    raw-stream lookup or allocations in between.
    """
    comments = [(i + 1, names) for i, line in enumerate(lines) for names in [listed_nodes(line)] if names is not None]
    previous = 0
    for s in statements:
        if not s.is_launch:
            continue
        found = [names for lineno, names in comments if previous < lineno < s.node.lineno]
        if found:
            s.origins = found[-1]
        previous = s.node.lineno


class _Groups:
    """Which storage group each name holds, in program order."""

    def __init__(self, inputs: tuple[str, ...]):
        self.of: dict[str, str] = {name: name for name in inputs}
        self.counter = 0

    def fresh(self, name: str) -> str:
        self.counter += 1
        group = f"{name}#{self.counter}"
        self.of[name] = group
        return group

    def get(self, name: str) -> str | None:
        return self.of.get(name)


def parse_wrapper(module_source: str, namespace: Mapping[str, Any], split_reuses: bool = False) -> KernelProgram:
    """Parse an inductor wrapper module into a :class:`KernelProgram`.

    ``namespace`` is the loaded module's globals: it resolves kernel objects
    and aten ops (for their schemas). With ``split_reuses``, each reuse line
    that :func:`splittable_reuses` proves renameable gives its new buffer a
    storage group of its own (listed in :attr:`KernelProgram.reuses`), so
    the launch DAG does not order the two buffers' launches.

    Raises:
        UnsupportedWrapper: the call function's shape is not one this parser knows.
    """
    tree = ast.parse(module_source)  # once: the kernels' source makes most of a wrapper
    fn = find_call_function(tree)
    lines = module_source.splitlines()
    signatures = kernel_signatures(tree)
    body, start, end = _schedulable_body(fn)
    inputs = _inputs(fn)
    outputs = _outputs(fn)

    def classify(split: frozenset[int]) -> list[Statement]:
        groups = _Groups(inputs)
        for s in body[:start]:  # names bound before the region (inputs, or a guard's prologue)
            for name in _stored(s):
                groups.of.setdefault(name, name)
        if body is not fn.body:
            for s in fn.body:
                for name in ([] if isinstance(s, ast.With) else _stored(s)):
                    groups.of.setdefault(name, name)
        statements = []
        for offset, node in enumerate(body[start:end]):
            statements.extend(_classify(start + offset, node, groups, signatures, namespace, split))
        _attach_origins(statements, lines)
        return statements

    statements = classify(frozenset())
    lines_of_reuse = reuse_lines(statements, lines)
    reuses: tuple[Reuse, ...] = ()
    if split_reuses and lines_of_reuse:
        storages = Storages.of(fn, statements, inputs, signatures, namespace)
        candidates = frozenset(i for i in lines_of_reuse if storages.known(i))
        while candidates:  # splitting one reuse can change what another sees; stop when all hold at once
            split = classify(candidates)
            found = splittable_reuses(split, candidates, lines_of_reuse, storages, inputs, outputs)
            if len(found) == len(candidates):
                statements, reuses = split, tuple(found[i] for i in sorted(found))
                break
            candidates = frozenset(found)
    return KernelProgram(fn, body, start, end, statements, inputs, outputs, body is not fn.body, reuses,
                         len(lines_of_reuse))


def source_namespace(module_source: str) -> dict[str, Any]:
    """Return what the wrapper's top level binds to torch objects (``aten = torch.ops.aten``), without running it.

    :func:`parse_wrapper` needs a namespace only to find the schemas of aten
    fallbacks; kernels are read from their source. Only assignments whose
    value is an attribute chain of ``torch`` are resolved (nothing is called
    or imported), so a wrapper checked in as a test fixture can be parsed on
    any machine; a name not resolved here leaves its calls as barriers.
    """
    namespace: dict[str, Any] = {"torch": torch}
    for node in ast.parse(module_source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute)):
            dotted = _dotted(node.value)
            if dotted is not None and dotted.startswith("torch."):
                value = _resolve(dotted, {"torch": torch})
                if value is not None:
                    namespace[node.targets[0].id] = value
    return namespace


def parse_wrapper_source(module_source: str) -> KernelProgram:
    """Parse a wrapper from its source alone (golden fixtures, tools): :func:`parse_wrapper` with :func:`source_namespace`."""
    return parse_wrapper(module_source, source_namespace(module_source))


def _group_set(names: set[str], groups: _Groups) -> set[str]:
    return {g for g in (groups.get(n) for n in names) if g is not None}


def _classify(index: int, node: ast.stmt, groups: _Groups, signatures: dict[str, KernelSignature],
              namespace: Mapping[str, Any], split: frozenset[int] = frozenset()) -> list[Statement]:
    uses = _names(node)
    if isinstance(node, ast.Delete):
        # one ``del`` per name, each at the line of the one it came from (an emitted call shares these nodes)
        return [Statement(index, ast.fix_missing_locations(ast.copy_location(
                              ast.Delete(targets=[ast.Name(id=n, ctx=ast.Del())]), node)), "del", frozenset({n}),
                          frozenset(), groups=frozenset(_group_set({n}, groups)))
                for t in node.targets for n in sorted(_stored(t))]
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        target, value = node.targets[0].id, node.value
        func = _dotted(value.func) if isinstance(value, ast.Call) else None
        if func is not None and func.split(".")[-1] in _STREAM_GETTERS:
            return [Statement(index, node, "stream", frozenset(uses), frozenset({target}))]
        source: str | None = None
        if isinstance(value, ast.Name):
            source = value.id
        elif isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name):
            source = value.value.id
        elif func is not None and func.split(".")[-1] in _VIEWS and value.args and isinstance(value.args[0], ast.Name):
            source = value.args[0].id
        if source is not None and groups.get(source) is not None:  # an alias: same storage, no kernel
            if index in split:  # a reuse given its own group; wrapper_emit decides which storage it gets
                group = groups.fresh(target)
            else:
                group = groups.get(source)
                groups.of[target] = group
            return [Statement(index, node, "host", frozenset(uses), frozenset({target}), groups=frozenset({group}),
                              bind_group=group)]
        if func is not None and func.split(".")[-1] in _ALLOCATORS:
            group = groups.fresh(target)
            return [Statement(index, node, "host", frozenset(uses), frozenset({target}), groups=frozenset({group}),
                              fresh=frozenset({group}), bind_group=group)]
        if isinstance(value, ast.Call):
            return [_launch(index, node, value, target, groups, signatures, namespace)]
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = _dotted(node.value.func)
        if func is not None and func.split(".")[-1] in _HOST_CHECKS:
            return [Statement(index, node, "host", frozenset(uses), frozenset(),
                              groups=frozenset(_group_set(uses, groups)))]
        return [_launch(index, node, node.value, None, groups, signatures, namespace)]
    return [_barrier(index, node, groups)]


def _barrier(index: int, node: ast.stmt, groups: _Groups) -> Statement:
    uses, binds = _names(node), _stored(node)
    touched = _group_set(uses, groups) | {WORLD}
    fresh = {groups.fresh(name) for name in binds}
    return Statement(index, node, "barrier", frozenset(uses), frozenset(binds), frozenset(touched),
                     frozenset(touched | fresh), (), frozenset((touched | fresh) - {WORLD}), frozenset(fresh),
                     next(iter(fresh)) if len(fresh) == 1 else None)


def _launch(index: int, node: ast.stmt, call: ast.Call, target: str | None, groups: _Groups,
            signatures: dict[str, KernelSignature], namespace: Mapping[str, Any]) -> Statement:
    """Classify a call: a known kernel launch with exact accesses, or a barrier."""
    uses = _names(node)
    func = _dotted(call.func)
    reads: set[str] = set()
    writes: set[str] = set()
    stored: set[str] = set()   # groups named by arguments the kernel only stores to
    other: set[str] = set()    # groups named by any other argument
    output_alias: str | None = None
    if func is None or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return _barrier(index, node, groups)  # unpacked arguments: which parameter gets what is unknown
    signature = _kernel_of(func, signatures)
    op = _resolve(func, namespace)
    typed: dict[str, set[torch.dtype | None]] = {}  # group -> element types of the arguments naming it
    if signature is not None:
        pairs = _kernel_arguments(call, signature)
        if pairs is None:
            return _barrier(index, node, groups)
        for param, arg in pairs:
            touched = _group_set(_names(arg), groups)
            reads |= touched
            # launch options (``stream=stream0``) name no storage; a storage passed any other way counts as written
            if param is None or param in signature.written:
                writes |= touched
            (stored if param is not None and param in signature.stores_only else other).update(touched)
            dtype = signature.dtypes.get(param) if isinstance(arg, ast.Name) and param is not None else None
            for group in touched:
                typed.setdefault(group, set()).add(dtype)
    elif func.startswith("extern_kernels."):
        reads = _group_set(uses, groups)
        if func[len("extern_kernels."):] in _EXTERN_OUT_ONLY:
            out = next((k.value for k in call.keywords if k.arg == "out"), None)
            if out is not None:
                writes = _group_set(_names(out), groups)
                stored = set(writes)  # these kernels overwrite ``out=`` (a matmul's ``beta`` scales ``self``)
                other = _group_set(set().union(*(_names(a) for a in call.args),
                                               *(_names(k.value) for k in call.keywords if k.arg != "out")), groups)
        else:  # an extern kernel whose writes we do not know: everything it is given may be written
            writes = set(reads)
    elif (func in _ALIGNING_COPIES and len(call.args) == 1 and not call.keywords
          and isinstance(call.args[0], ast.Name) and groups.get(call.args[0].id) is not None and target is not None):
        # the argument itself, or a copy of it made now on this statement's stream: either way its readers
        # must come after this statement, so it reads and writes the argument's group and binds the name to it
        output_alias = groups.get(call.args[0].id)
        reads, writes = {output_alias}, {output_alias}
    elif (isinstance(call.func, ast.Attribute) and call.func.attr in _INPLACE_METHODS
          and isinstance(call.func.value, ast.Name) and groups.get(call.func.value.id) is not None
          and target is None):
        reads = _group_set(uses, groups)
        writes = _group_set({call.func.value.id}, groups)
        stored = set(writes)  # ``zero_()`` sets every element, whatever was there
        other = _group_set(set().union(*(_names(a) for a in call.args), *(_names(k.value) for k in call.keywords)),
                           groups)
    elif compat.is_op_overload(op):
        reads = _group_set(uses, groups)
        schema = compat.op_schema(op)
        bound = _bind_schema(schema, call)
        for arg in schema.arguments:
            info = arg.alias_info
            if info is not None and info.is_write and arg.name in bound:
                writes |= _group_set(_names(bound[arg.name]), groups)
        if torch.Tag.nondeterministic_seeded in op.tags:
            reads.add(RNG)
            writes.add(RNG)
        if len(schema.returns) > 1 and any(r.alias_info is not None for r in schema.returns):
            return _barrier(index, node, groups)  # several returns aliasing arguments: not one group to bind
        ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        if ret is not None:
            source = next((bound[a.name] for a in schema.arguments if a.alias_info is not None
                           and a.alias_info.before_set == ret.before_set and a.name in bound), None)
            aliased = _group_set(_names(source), groups) if source is not None else set()
            if len(aliased) != 1:
                return _barrier(index, node, groups)
            output_alias = next(iter(aliased))
    else:
        return _barrier(index, node, groups)
    reads.add(WORLD)
    binds: set[str] = set()
    fresh: set[str] = set()
    group = None
    if target is not None:
        binds = {target}
        if output_alias is not None:
            group = groups.of[target] = output_alias
        else:
            group = groups.fresh(target)
            fresh.add(group)
            writes.add(group)
    touched = reads | writes | _group_set(uses | binds, groups)
    dtypes = {g: next(iter(types)) for g, types in typed.items() if len(types) == 1 and None not in types}
    return Statement(index, node, "launch", frozenset(uses), frozenset(binds), frozenset(reads),
                     frozenset(writes), (), frozenset(touched - {WORLD, RNG}), frozenset(fresh), group,
                     frozenset((stored & writes) - other), dtypes, allocates=signature is None)


def _kernel_arguments(call: ast.Call, signature: KernelSignature) -> list[tuple[str | None, ast.expr]] | None:
    """Return (parameter, argument) for each argument of a kernel launch; None if there are more than parameters.

    Positional arguments go to the parameters in order, keywords by name;
    a keyword that names no parameter (``stream=stream0``, a launch option)
    pairs with None.
    """
    if len(call.args) > len(signature.params):
        return None
    pairs: list[tuple[str | None, ast.expr]] = list(zip(signature.params, call.args))
    pairs += [(k.arg, k.value) for k in call.keywords if k.arg in signature.params]
    pairs += [(None, k.value) for k in call.keywords if k.arg not in signature.params]
    return pairs

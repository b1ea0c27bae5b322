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

Which storages a launch only *stores* to (never reads) is proven the same
way, for ``split_reuses`` (:class:`Reuse`): a triton pointer whose every use
is the address of a ``tl.store`` and that is not a mutated argument, a C++
pointer the body only stores through in inductor's two store shapes, the
``out=`` of the known extern kernels and ``buf.zero_()``; anything else may
read, so a reuse before it keeps inductor's alias. The new buffer's own
storage repeats the old buffer's allocator call or, where no allocator
call made that memory (an input, an extern kernel's result, a tuple item),
takes the size and stride the wrapper asserts and the element type the
first kernel declares (:func:`_stated_fresh`); where those are missing or
disagree, the alias stays. ``tests/test_golden_wrappers.py`` checks real
wrappers of each version in :data:`TESTED_TORCH_VERSIONS` against
inductor's own scheduler.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from concur.dag.annotate import RNG
# KernelSignature and kernel_signatures stay importable from here, where they were first
from concur.inductor.kernel_signatures import (_ALLOCATORS, _COPYABLE_ALLOCATORS, KernelSignature, _dotted,
                                              kernel_signatures)

WORLD = "<world>"  # read by every launch, written by barriers

# torch versions whose real wrappers are checked in (tests/fixtures/wrappers) and checked against inductor's
# own scheduler by tests/test_golden_wrappers.py: 2.11 on an H100 (triton), 2.13 and 2.14.1 on CPU (C++)
TESTED_TORCH_VERSIONS = ("2.11.0", "2.13.0", "2.14.1")

_VIEWS = {"reinterpret_tensor", "as_strided", "alias"}
_HOST_CHECKS = {"assert_size_stride", "assert_size_stride_grouped", "assert_tensor_metadata",
                "assert_alignment", "check_alignment", "set_device"}  # host-side only: no kernel
_STREAM_GETTERS = {"get_raw_stream"}
# ``buf.zero_()``: how inductor zeroes a workspace or the graph's semaphores before the kernels using them
_INPLACE_METHODS = {"zero_"}
# extern kernels that write only their ``out=`` (and the tensor they return); any other writes every argument
_EXTERN_OUT_ONLY = {"convolution", "mm", "addmm", "bmm", "baddbmm", "bias_addmm", "_int_mm", "_mm_plus_mm",
                    "mm_dtype", "bmm_dtype", "_scaled_mm", "conv1x1_via_mm"}


@dataclass
class Statement:
    """One statement of the wrapper body, with what it needs and what it touches."""

    index: int                      # position in the original body
    node: ast.stmt
    kind: str                       # "launch", "barrier", "host", "del", "stream" (a raw-stream lookup)
    uses: frozenset[str]            # names read
    binds: frozenset[str]           # names (re)bound
    reads: frozenset[str] = frozenset()    # storage groups a launch reads
    writes: frozenset[str] = frozenset()   # storage groups a launch writes
    origins: tuple[str, ...] = ()   # fx nodes inductor lists in the comment above ("Source Nodes")
    groups: frozenset[str] = frozenset()   # storage groups of every name used or bound
    fresh: frozenset[str] = frozenset()    # groups this statement allocates (their home stream is its stream)
    bind_group: str | None = None   # the group of the name it binds (assignments)
    # groups a launch only stores to: every argument naming them is a pointer it never reads through
    stores_only: frozenset[str] = frozenset()
    # group -> element type, where every argument of a launch naming the group is one of its names passed
    # to a kernel pointer of a declared element type, and those types agree (see :attr:`KernelSignature.dtypes`)
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)

    @property
    def is_launch(self) -> bool:
        return self.kind in ("launch", "barrier")


@dataclass
class KernelProgram:
    """The ``call`` function of an inductor wrapper, with its schedulable body parsed."""

    function: ast.FunctionDef
    body: list[ast.stmt]            # the list that is rescheduled (a device guard's body, or the function's)
    start: int                      # body[start:end] are the statements; the rest stays in place
    end: int
    statements: list[Statement]
    inputs: tuple[str, ...]         # names unpacked from ``args``
    outputs: tuple[str, ...]        # names in the return statement
    guarded: bool                   # the body is a device guard's (``with torch.cuda._DeviceGuard(0):``)
    reuses: tuple["Reuse", ...] = ()  # reuse lines whose new buffer has a storage group of its own
    reuse_lines: int = 0            # every ``bufN = bufM; del bufM  # reuse`` line, split or not

    @property
    def launches(self) -> list[Statement]:
        return [s for s in self.statements if s.is_launch]


@dataclass(frozen=True)
class Reuse:
    """A reuse line whose new buffer was given a storage group of its own (``split_reuses``).

    ``buf9 = buf5; del buf5  # reuse`` puts buf9 in buf5's dead memory,
    which orders buf9's first writer after every launch that touched buf5.
    When that writer only stores to buf9 (it never reads what buf5 left),
    the order is not a dependence: the parse gives buf9 a group of its own,
    and :func:`concur.inductor.wrapper_emit.plan_emission` keeps the reuse only
    where its schedule orders the two buffers anyway, otherwise it emits
    :attr:`fresh`, an allocation made like buf5's.
    """

    statement: int                  # index of the alias statement (``buf9 = buf5``)
    old_group: str
    new_group: str
    first_access: int               # index of the first launch touching the new group: it only stores to it
    fresh: Statement                # replaces the alias when the reuse is not kept
    # where the fresh allocation's layout comes from: "allocation" (the old buffer's allocator call, repeated)
    # or "stated" (the size and stride the wrapper states, the type the first kernel declares: _stated_fresh)
    made_from: str = "allocation"


class UnsupportedWrapper(ValueError):
    """The wrapper's shape is not one concur can reschedule; the graph then runs as inductor made it."""


# -- the call function -------------------------------------------------------------------------

def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _stored(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


def _resolve(dotted: str, namespace: Mapping[str, Any]) -> Any:
    head, *rest = dotted.split(".")
    value = namespace.get(head)
    for atom in rest:
        if value is None:
            return None
        value = getattr(value, atom, None)
    return value


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


def _attach_origins(statements: list["Statement"], lines: list[str]) -> None:
    """Give each launch the fx nodes of the last "Source Nodes" comment between it and the launch before.

    Inductor writes the comment above a kernel's launch, sometimes with the
    raw-stream lookup or allocations in between.
    """
    comments = [(i + 1, tuple(x.strip() for x in m.group(1).split(",") if x.strip()))
                for i, line in enumerate(lines) for m in [_ORIGINS.search(line)] if m]
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
    that :func:`_splittable_reuses` proves renameable gives its new buffer a
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
    lines_of_reuse = _reuse_lines(statements, lines)
    reuses: tuple[Reuse, ...] = ()
    if split_reuses and lines_of_reuse:
        storages = _Storages.of(fn, statements, inputs, signatures, namespace)
        candidates = frozenset(i for i in lines_of_reuse if storages.known(i))
        while candidates:  # splitting one reuse can change what another sees; stop when all hold at once
            split = classify(candidates)
            found = _splittable_reuses(split, candidates, lines_of_reuse, storages, inputs, outputs)
            if len(found) == len(candidates):
                statements, reuses = split, tuple(found[i] for i in sorted(found))
                break
            candidates = frozenset(found)
    return KernelProgram(fn, body, start, end, statements, inputs, outputs, body is not fn.body, reuses,
                         len(lines_of_reuse))


# -- buffer reuse ------------------------------------------------------------------------------

_REUSE_COMMENT = re.compile(r"#\s*reuse\s*$")


def _reuse_lines(statements: list[Statement], lines: list[str]) -> dict[int, tuple[str, str]]:
    """Return {alias statement index: (new name, old name)} for each ``bufN = bufM; del bufM  # reuse`` line.

    Only the shapes inductor writes count: an alias of a name, or
    ``reinterpret_tensor`` of one, followed by the ``del`` of that name on
    the same line, which ends with the comment.
    """
    found = {}
    for s, after in zip(statements, statements[1:]):
        node = s.node
        if s.kind != "host" or s.fresh or s.bind_group is None or not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Call) and _dotted(value.func) == "reinterpret_tensor" and value.args:
            value = value.args[0]
        if not isinstance(value, ast.Name) or after.kind != "del" or after.uses != {value.id} \
                or after.index != s.index + 1:
            continue
        line = lines[node.lineno - 1] if 0 < node.lineno <= len(lines) else ""
        if _REUSE_COMMENT.search(line) and re.search(rf";\s*del {re.escape(value.id)}\b", line):
            found[s.index] = (node.targets[0].id, value.id)
    return found


def _whole_allocations(statements: list[Statement], inputs: tuple[str, ...]) -> dict[int, ast.Call]:
    """Return {alias statement index: allocator call} where the alias's source names that whole allocation.

    A name holds a whole allocation when an allocator call of constant
    arguments bound it, or a plain alias of such a name did; a view, an
    input, a kernel's result or a barrier's never does, so a reuse of one
    keeps its alias.
    """
    local = set(inputs).union(*(s.binds for s in statements))
    whole: dict[str, ast.Call] = {}
    found: dict[int, ast.Call] = {}
    for s in statements:
        node = s.node
        if s.kind == "host" and s.bind_group is not None and isinstance(node, ast.Assign):
            target, value = node.targets[0].id, node.value
            func = _dotted(value.func) if isinstance(value, ast.Call) else None
            if s.fresh and func is not None and func.split(".")[-1] in _COPYABLE_ALLOCATORS \
                    and not (_names(value) & local):
                whole[target] = value
                continue
            source = value.args[0] if func == "reinterpret_tensor" and value.args else value
            if isinstance(source, ast.Name) and source.id in whole:
                found[s.index] = whole[source.id]
                if source is value:
                    whole[target] = whole[source.id]
                    continue
        for name in s.binds | (s.uses if s.kind == "del" else set()):
            whole.pop(name, None)
    return found


def _splittable_reuses(statements: list[Statement], candidates: frozenset[int], reuse_lines: dict[int, tuple[str, str]],
                       storages: "_Storages", inputs: tuple[str, ...], outputs: tuple[str, ...]) -> dict[int, Reuse]:
    """Return the candidates that hold in ``statements`` (parsed with them split), each as a :class:`Reuse`.

    A reuse may be split only when nothing but the dead memory ties the two
    buffers, each proven, else it keeps its alias:

    - the first launch touching the new group only stores to it
      (:attr:`Statement.stores_only`): an in-place kernel (``in_out_ptr``)
      reads what the old buffer left, a true dependence;
    - no other name of the old group (an earlier view or alias) is named
      after the reuse line, nor returned: the old storage is really dead;
    - a launch touched the old group after its name was bound, so the
      alias can be placed where that name is already bound;
    - :class:`_Storages` knows how to allocate the new buffer afresh
      (:attr:`Reuse.fresh`).
    """
    state = {name: name for name in inputs}
    named: dict[str, list[int]] = {}     # group -> positions of statements naming it
    touched: dict[str, list[int]] = {}   # group -> positions of launches accessing it
    old_of: dict[int, tuple[str | None, int]] = {}  # candidate -> (its source's group, where the source was bound)
    bound_at: dict[str, int] = {}
    for k, s in enumerate(statements):
        if s.index in candidates and s.kind == "host":
            source = reuse_lines[s.index][1]
            old_of[s.index] = (state.get(source), bound_at.get(source, -1))
        for name in s.uses:
            if state.get(name) is not None:
                named.setdefault(state[name], []).append(k)
        if s.is_launch:
            for g in s.groups | s.reads | s.writes:
                touched.setdefault(g, []).append(k)
        if s.kind == "del":
            for name in s.uses:
                state.pop(name, None)
        for name in s.binds:
            bound_at[name] = k
            if s.bind_group is None:
                state.pop(name, None)
            else:
                state[name] = s.bind_group
                named.setdefault(s.bind_group, []).append(k)
    for name in outputs:
        if state.get(name) is not None:
            named.setdefault(state[name], []).append(len(statements))
    found = {}
    for k, s in enumerate(statements):
        if s.index not in old_of:
            continue
        old, source_bound = old_of[s.index]
        new = s.bind_group
        own_del = k + 1  # the reuse line's own ``del`` of the old name
        if old is None or new is None or old == new:
            continue
        if any(p > k and p != own_del for p in named.get(old, ())) or any(p > k for p in touched.get(old, ())):
            continue
        if not any(source_bound < p < k for p in touched.get(old, ())):
            continue
        first = next((p for p in touched.get(new, ()) if p > k), None)
        if first is None or new not in statements[first].stores_only:
            continue
        fresh = storages.fresh(statements, k, first, old)
        if fresh is not None:
            found[s.index] = Reuse(s.index, old, new, statements[first].index, *fresh)
    return found


@dataclass(frozen=True)
class _Layout:
    """A tensor's size and stride, both constant."""

    size: tuple[int, ...]
    stride: tuple[int, ...]


class _TensorFacts:
    """What the wrapper states about one tensor's layout and dtype; a plain alias shares its source's facts."""

    def __init__(self, layout: _Layout | None = None, unreadable: bool = False,
                 dtypes: Iterable[torch.dtype] = ()):
        self.layouts: set[_Layout] = {layout} if layout is not None else set()
        self.unreadable = unreadable  # a statement of its layout this module cannot read (symbolic sizes)
        self.dtypes: set[torch.dtype] = set(dtypes)  # from allocator calls, its own or a viewed tensor's

    def learn(self, layout: _Layout | None) -> None:
        if layout is None:
            self.unreadable = True
        else:
            self.layouts.add(layout)

    def layout(self) -> _Layout | None:
        """The one layout every statement agrees on; None if none was stated, one was not read, or two differ."""
        return next(iter(self.layouts)) if len(self.layouts) == 1 and not self.unreadable else None


def _constant_layout(size: ast.expr, stride: ast.expr) -> _Layout | None:
    """Return the layout of a size and a stride written as tuples of integers, or None (a symbol, anything else)."""
    try:
        values = ast.literal_eval(size), ast.literal_eval(stride)
    except (ValueError, TypeError, SyntaxError):
        return None
    if not all(isinstance(v, tuple) and all(type(x) is int for x in v) for v in values):
        return None
    if len(values[0]) != len(values[1]):
        return None
    return _Layout(*values)


def _constant_dtype(node: ast.expr) -> torch.dtype | None:
    """Return the dtype an expression such as ``torch.float32`` names, or None."""
    dotted = _dotted(node) or ""
    head, _, attr = dotted.rpartition(".")
    value = getattr(torch, attr, None) if head == "torch" else None
    return value if isinstance(value, torch.dtype) else None


def _asserted_layouts(call: ast.Call) -> list[tuple[str, _Layout | None]]:
    """Return (name, layout) for each tensor an ``assert_size_stride`` (or its grouped form) checks; None: unread."""
    func = (_dotted(call.func) or "").split(".")[-1]
    if func not in ("assert_size_stride", "assert_size_stride_grouped") or len(call.args) < 3:
        return []
    tensors, sizes, strides = call.args[:3]
    if func == "assert_size_stride":
        return [(tensors.id, _constant_layout(sizes, strides))] if isinstance(tensors, ast.Name) else []
    if not isinstance(tensors, ast.Tuple):
        return []
    names = [t.id for t in tensors.elts if isinstance(t, ast.Name)]
    if not (isinstance(sizes, ast.Tuple) and isinstance(strides, ast.Tuple)
            and len(names) == len(tensors.elts) == len(sizes.elts) == len(strides.elts)):
        return [(name, None) for name in names]
    return [(name, _constant_layout(size, stride)) for name, size, stride in zip(names, sizes.elts, strides.elts)]


def _restrided(call: ast.Call, signatures: Mapping[str, KernelSignature], namespace: Mapping[str, Any]) -> set[str]:
    """Return the names whose size or stride ``call`` may change.

    A compiled kernel, an extern kernel writing its ``out=``, ``zero_()``,
    an allocator, a view or a host check changes at most what memory holds;
    an aten op may restride the arguments its schema says it writes
    (``resize_``, ``set_``, ``as_strided_``); any other call, every name
    it is given.
    """
    func = _dotted(call.func) or ""
    if func.split(".")[-1] in _ALLOCATORS | _VIEWS | _HOST_CHECKS | _STREAM_GETTERS | _INPLACE_METHODS:
        return set()
    if _kernel_of(func, signatures) is not None or func.removeprefix("extern_kernels.") in _EXTERN_OUT_ONLY:
        return set()
    op = _resolve(func, namespace)
    if not isinstance(op, torch._ops.OpOverload):
        return _names(call)
    bound = _bind_schema(op._schema, call)
    return {name for arg in op._schema.arguments if arg.alias_info is not None and arg.alias_info.is_write
            and arg.name in bound for name in _names(bound[arg.name])}


def _stated_facts(fn: ast.FunctionDef, signatures: Mapping[str, KernelSignature],
                  namespace: Mapping[str, Any]) -> dict[ast.stmt, _TensorFacts]:
    """Return, for each assignment of the call function, what the wrapper states about the tensor it binds.

    Facts come only from what the wrapper writes with constants:

    - ``assert_size_stride(name, size, stride, ...)`` (and its grouped
      form), which inductor writes for the graph's inputs at the top of
      ``call`` and after each extern kernel's result or tuple item;
    - an allocator call's size, stride and dtype;
    - ``reinterpret_tensor(x, size, stride, 0)``: the view's own layout, and
      x's dtype. A view at another offset states no layout a fresh
      allocation could replace;
    - a plain alias ``a = b`` shares b's facts: inductor aliases a reused
      buffer only when size and stride are equal, and a later statement
      about either name is checked against the same facts.

    Any other binding starts with none, so only an assertion can prove it,
    and a call that may restride a tensor (:func:`_restrided`) leaves
    nothing proven about it.
    """
    facts: dict[str, _TensorFacts] = {}
    bound: dict[ast.stmt, _TensorFacts] = {}

    def assigned(value: ast.expr) -> _TensorFacts:
        func = (_dotted(value.func) or "").split(".")[-1] if isinstance(value, ast.Call) else None
        if isinstance(value, ast.Name):
            return facts.setdefault(value.id, _TensorFacts())
        if func in _ALLOCATORS and len(value.args) >= 3 and not value.keywords:
            layout = _constant_layout(value.args[0], value.args[1])
            dtype = _constant_dtype(value.args[2])
            return _TensorFacts(layout, layout is None, [dtype] if dtype is not None else [])
        if func == "reinterpret_tensor" and len(value.args) == 4 and not value.keywords:
            source, size, stride, offset = value.args
            layout = _constant_layout(size, stride)
            at_start = isinstance(offset, ast.Constant) and type(offset.value) is int and offset.value == 0
            viewed = facts.get(source.id) if isinstance(source, ast.Name) else None
            return _TensorFacts(layout, layout is None or not at_start, viewed.dtypes if viewed else ())
        return _TensorFacts()

    def unproven(names: set[str]) -> None:
        for name in names:
            facts.setdefault(name, _TensorFacts()).unreadable = True

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.With):
                visit(node.body)
                continue
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                unproven(_restrided(call, signatures, namespace))
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                facts[node.targets[0].id] = bound[node] = assigned(node.value)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                for name, layout in _asserted_layouts(node.value):
                    facts.setdefault(name, _TensorFacts()).learn(layout)
            elif isinstance(node, ast.Delete):
                for name in _stored(node):
                    facts.pop(name, None)
            else:  # another binding (``primals_1, primals_2 = args``): nothing known of what it binds
                for name in _stored(node):
                    facts[name] = _TensorFacts()

    visit(fn.body)
    return bound


@dataclass(frozen=True)
class _Storages:
    """How a split reuse's new buffer gets storage of its own, when it is not kept in the old buffer's.

    Either the old name holds a whole allocation (:func:`_whole_allocations`),
    whose allocator call is repeated (:func:`_fresh_allocation`), or the
    wrapper states the new buffer's layout and its first kernel declares
    its element type (:func:`_stated_fresh`): the dead memory of an input,
    an extern kernel's result, a tuple item, or a view of any of them.
    """

    allocations: Mapping[int, ast.Call]           # reuse line -> the allocator call its old name holds
    stated: Mapping[int, _TensorFacts]            # reuse line -> the facts of its new name, with a layout
    signatures: Mapping[str, KernelSignature]
    allocators: frozenset[str]                    # the allocators the call function calls

    @classmethod
    def of(cls, fn: ast.FunctionDef, statements: list[Statement], inputs: tuple[str, ...],
           signatures: Mapping[str, KernelSignature], namespace: Mapping[str, Any]) -> "_Storages":
        facts = _stated_facts(fn, signatures, namespace)
        stated = {s.index: facts[s.node] for s in statements if s.node in facts and facts[s.node].layout()}
        allocators = frozenset(func.split(".")[-1] for s in statements if s.fresh and s.kind == "host"
                               and isinstance(s.node, ast.Assign) and isinstance(s.node.value, ast.Call)
                               for func in [_dotted(s.node.value.func) or ""])
        return cls(_whole_allocations(statements, inputs), stated, signatures, allocators)

    def known(self, line: int) -> bool:
        """Whether the reuse line's new buffer could be allocated afresh, before its first kernel is known."""
        return line in self.allocations or line in self.stated

    def fresh(self, statements: list[Statement], k: int, first: int, old: str) -> tuple[Statement, str] | None:
        """Return (the statement allocating reuse ``statements[k]``'s new buffer, :attr:`Reuse.made_from`), or None."""
        alias = statements[k]
        if alias.index in self.allocations:
            return _fresh_allocation(alias, self.allocations[alias.index]), "allocation"
        fresh = _stated_fresh(alias, self.stated[alias.index], statements, first, old, self.signatures,
                              self.allocators)
        return (fresh, "stated") if fresh is not None else None


def _stated_fresh(alias: Statement, facts: _TensorFacts, statements: list[Statement], first: int, old: str,
                  signatures: Mapping[str, KernelSignature], allocators: frozenset[str]) -> Statement | None:
    """Return the statement binding the reuse's new name to an allocation of its stated layout and type, or None.

    ``buf9 = buf5`` becomes ``buf9 = empty_strided_cuda(size, stride, dtype)``:

    - size and stride: the layout the wrapper states (:func:`_stated_facts`);
    - dtype: the element type the first launch's kernel declares for the
      pointers it stores the new buffer through (:attr:`Statement.dtypes`).
      Inductor reuses memory only between buffers of one dtype, so every
      other launch declaring a type for the new or the old group, and an
      allocator call the old memory comes from, must say the same, else
      the types are not understood and the alias stays;
    - device: the allocator of that kernel's device, which the call
      function must already call.
    """
    launch = statements[first]
    call = launch.node.value if isinstance(launch.node, (ast.Expr, ast.Assign)) else None
    func = _dotted(call.func) if isinstance(call, ast.Call) else None
    signature = _kernel_of(func, signatures) if func is not None else None
    layout = facts.layout()
    if signature is None or signature.allocator not in allocators or layout is None:
        return None
    new = alias.bind_group
    dtype = launch.dtypes.get(new)
    if dtype is None or not facts.dtypes <= {dtype}:
        return None
    if any(s.dtypes.get(g, dtype) != dtype for s in statements if s.is_launch for g in (old, new)):
        return None
    value = ast.parse(f"{signature.allocator}({layout.size!r}, {layout.stride!r}, {dtype})", mode="eval").body
    return _fresh_statement(alias, value)


def _fresh_allocation(alias: Statement, allocation: ast.Call) -> Statement:
    """Return the statement binding the reuse's new name to a fresh allocation made like the old buffer's.

    ``buf9 = buf5`` becomes ``buf9 = <buf5's allocator call>``;
    ``buf9 = reinterpret_tensor(buf5, ...)`` reinterprets such a call the same way.
    """
    node = alias.node
    assert isinstance(node, ast.Assign)
    value = copy.deepcopy(node.value)
    if isinstance(value, ast.Call):
        value.args[0] = copy.deepcopy(allocation)
    else:
        value = copy.deepcopy(allocation)
    return _fresh_statement(alias, value)


def _fresh_statement(alias: Statement, value: ast.expr) -> Statement:
    """Return the statement binding the alias's name to ``value``, a fresh allocation of its own group."""
    node = alias.node
    assert isinstance(node, ast.Assign)
    statement = ast.copy_location(ast.Assign(targets=copy.deepcopy(node.targets), value=value), node)
    group = alias.bind_group
    return Statement(alias.index, statement, "host", frozenset(_names(statement)), alias.binds,
                     groups=frozenset({group}), fresh=frozenset({group}), bind_group=group)


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
        return [Statement(index, ast.Delete(targets=[ast.Name(id=n, ctx=ast.Del())]), "del", frozenset({n}),
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
    elif (isinstance(call.func, ast.Attribute) and call.func.attr in _INPLACE_METHODS
          and isinstance(call.func.value, ast.Name) and groups.get(call.func.value.id) is not None
          and target is None):
        reads = _group_set(uses, groups)
        writes = _group_set({call.func.value.id}, groups)
        stored = set(writes)  # ``zero_()`` sets every element, whatever was there
        other = _group_set(set().union(*(_names(a) for a in call.args), *(_names(k.value) for k in call.keywords)),
                           groups)
    elif isinstance(op, torch._ops.OpOverload):
        reads = _group_set(uses, groups)
        schema = op._schema
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
                     frozenset((stored & writes) - other), dtypes)


def _kernel_of(func: str, signatures: Mapping[str, KernelSignature]) -> KernelSignature | None:
    """Return the signature of the compiled kernel a call launches (``triton_poi_x.run``, ``cpp_fused_x``)."""
    return signatures.get(func[:-len(".run")] if func.endswith(".run") else func)


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


def _bind_schema(schema: torch.FunctionSchema, call: ast.Call) -> dict[str, ast.AST]:
    bound: dict[str, ast.AST] = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for arg, value in zip(positional, call.args):
        bound[arg.name] = value
    for k in call.keywords:
        if k.arg is not None:
            bound[k.arg] = k.value
    return bound

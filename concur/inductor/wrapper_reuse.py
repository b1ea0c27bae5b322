"""Which of inductor's buffer reuses order launches for nothing, and the fresh storage that replaces them.

Inductor puts a new buffer in a dead one's memory (``buf9 = buf5; del buf5
# reuse``), which orders buf9's first writer after every launch that touched
buf5: no dependence when that writer never reads what buf5 left, but an
order that chains independent branches once they run on several streams.
:func:`concur.inductor.wrapper_parse.parse_wrapper` (``split_reuses``) asks
this module which reuse lines can give the new buffer a storage group of its
own (:class:`~concur.inductor.wrapper_program.Reuse`), and how to allocate it.

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
disagree, the alias stays.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from concur import _torch_compat as compat
from concur.inductor.kernel_signatures import _ALLOCATORS, _COPYABLE_ALLOCATORS, KernelSignature, _dotted
from concur.inductor.wrapper_program import (_EXTERN_OUT_ONLY, _HOST_CHECKS, _INPLACE_METHODS, _STREAM_GETTERS,
                                            _VIEWS, Reuse, Statement, _bind_schema, _kernel_of, _names, _resolve,
                                            _stored)

_REUSE_COMMENT = re.compile(r"#\s*reuse\s*$")


def reuse_lines(statements: list[Statement], lines: list[str]) -> dict[int, tuple[str, str]]:
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


def splittable_reuses(statements: list[Statement], candidates: frozenset[int], reuse_lines: dict[int, tuple[str, str]],
                       storages: "Storages", inputs: tuple[str, ...], outputs: tuple[str, ...]) -> dict[int, Reuse]:
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
    - :class:`Storages` knows how to allocate the new buffer afresh
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
    schema = compat.op_schema(_resolve(func, namespace))
    if schema is None:
        return _names(call)
    bound = _bind_schema(schema, call)
    return {name for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write
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
class Storages:
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
           signatures: Mapping[str, KernelSignature], namespace: Mapping[str, Any]) -> "Storages":
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

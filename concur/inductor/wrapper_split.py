"""Split a compiled backward's joint convolution backward calls in the program that runs on several streams only.

Inductor compiles the backward graph as AOTAutograd made it, with one
``convolution_backward`` per convolution computing the input and the weight
gradient together: that is the program a user gets from ``torch.compile``
(and the recipe concur is measured against), and the one concur keeps when
one stream is as fast. Only the program concur puts on several streams
splits each joint call into its input-gradient call, which stays on the
critical path, and its weight(+bias)-gradient call, which a side stream can
take (:mod:`concur.inductor.backward_split` says why and what the split must
keep). So the one-stream program concur measures a plan against is
inductor's own, not a split one, which can run slower on one stream than
the joint call, and no second compile is needed.

The rewrite is on the wrapper's text, before :mod:`concur.inductor.wrapper_parse`
reads it, so the parser sees two ordinary aten fallback calls::

    # Topologically Sorted Source Nodes: [convolution_backward_2.input], ...
    buf13 = torch.ops.aten.convolution_backward.default(buf12, x, w, ..., [True, False, False])
    # Topologically Sorted Source Nodes: [convolution_backward_2.weight], ...
    buf13_weight_grad = torch.ops.aten.convolution_backward.default(buf12, x, w, ..., [False, True, False])

and ``buf15 = buf13[1]`` becomes ``buf15 = buf13_weight_grad[1]``. Each
part gets a "Source Nodes" comment of its own, naming the cost that
:func:`concur.inductor.backward_split.split_calls` predicted for it. A call is
split only where everything about it is read: one line, the mask of exactly
one joint call of the graph listed above it, and its result used only
through ``[0]``, ``[1]``, ``[2]`` and ``del``; any other call stays joint.
"""

from __future__ import annotations

import ast
from typing import Mapping

from concur.inductor.kernel_signatures import _dotted
from concur.inductor.backward_split import _OUTPUT_MASK as _MASK
from concur.inductor.backward_split import SplitCall
from concur.inductor.wrapper_parse import find_call_function, listed_nodes

CONVOLUTION_BACKWARD = "torch.ops.aten.convolution_backward.default"


def split_weight_gradient_calls(module_source: str, calls: Mapping[str, SplitCall]
                                ) -> tuple[str, tuple[SplitCall, ...]]:
    """Return the wrapper source with the joint calls of ``calls`` split, and the splits it made."""
    if not calls:
        return module_source, ()
    tree = ast.parse(module_source)
    lines = module_source.splitlines()
    statements = sorted((n for n in ast.walk(find_call_function(tree)) if isinstance(n, ast.stmt)),
                        key=lambda n: n.lineno)
    found: dict[str, tuple[ast.Assign, SplitCall]] = {}  # joint result's name -> its statement and split
    taken: set[str] = set()
    for stmt in statements:
        joint = _joint_call(stmt)
        if joint is None:
            continue
        mask = tuple(e.value for e in joint.value.args[_MASK].elts)
        listed = _listed_above(lines, stmt.lineno)
        matches = [calls[n] for n in listed if n in calls and n not in taken and calls[n].mask == mask]
        if len(matches) == 1:
            found[joint.targets[0].id] = (joint, matches[0])
            taken.add(matches[0].source)
    taken_names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    users: dict[str, list[ast.stmt]] = {name: [] for name in found}
    for stmt in statements:
        # a compound statement's body is walked statement by statement
        if not isinstance(stmt, (ast.With, ast.FunctionDef, ast.ClassDef, ast.Try)):
            for name in {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)} & users.keys():
                users[name].append(stmt)
    for name in list(found):
        if not all(_read_by_index_or_deleted(stmt, name, found[name][0]) for stmt in users[name]) \
                or {_weight(name), _input_copy(name)} & taken_names:
            del found[name]
    if not found:
        return module_source, ()
    edits: dict[int, list[str]] = {}  # line index (0-based) -> its replacement lines
    for stmt in statements:
        line = lines[stmt.lineno - 1]
        indent = line[:len(line) - len(line.lstrip())]
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id in found:
            if found[stmt.targets[0].id][0] is stmt:
                edits[stmt.lineno - 1] = _split_lines(stmt, found[stmt.targets[0].id][1], indent)
                continue
        joint = _indexed_joint(stmt, found)
        if joint is not None and stmt.value.slice.value in (1, 2):
            stmt.value.value = ast.Name(_weight(joint), ast.Load())
            edits[stmt.lineno - 1] = [indent + ast.unparse(stmt)]
        elif isinstance(stmt, ast.Delete):
            dead = [t.id for t in stmt.targets if isinstance(t, ast.Name) and t.id in found]
            if dead:
                edits[stmt.lineno - 1] = [line] + [f"{indent}del {_weight(name)}" for name in dead]
    out = []
    for i, line in enumerate(lines):
        out.extend(edits.get(i, [line]))
    return "\n".join(out) + ("\n" if module_source.endswith("\n") else ""), tuple(s for _, s in found.values())


def split_costs(node_costs: Mapping[str, tuple[float, dict]], done: tuple[SplitCall, ...]
                ) -> dict[str, tuple[float, dict]]:
    """Return ``node_costs`` (by source name) for the split program: each split call's cost by its parts.

    The joint call's name leaves the table: the fused kernel launched before
    the call often lists it too, and must not take its cost.
    """
    costs = dict(node_costs)
    for split in done:
        costs.pop(split.source, None)
        costs.update(split.costs)
    return costs


def _joint_call(stmt: ast.stmt) -> ast.Assign | None:
    """Return ``stmt`` if it is a one-line ``name = convolution_backward(..., [True, w, b])`` with w or b."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.lineno == stmt.end_lineno and isinstance(stmt.value, ast.Call)
            and _dotted(stmt.value.func) == CONVOLUTION_BACKWARD and not stmt.value.keywords
            and len(stmt.value.args) == _MASK + 1):
        return None
    mask = stmt.value.args[_MASK]
    if not (isinstance(mask, (ast.List, ast.Tuple)) and len(mask.elts) == 3
            and all(isinstance(e, ast.Constant) and isinstance(e.value, bool) for e in mask.elts)):
        return None
    values = [e.value for e in mask.elts]
    return stmt if values[0] and (values[1] or values[2]) else None


def _listed_above(lines: list[str], lineno: int) -> tuple[str, ...]:
    """Return the nodes of the "Source Nodes" comment in the block of comment lines right above line ``lineno``."""
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        names = listed_nodes(lines[i])
        if names is not None:
            return names
        i -= 1
    return ()


def _indexed_joint(stmt: ast.stmt, found: Mapping[str, object]) -> str | None:
    """Return the joint result ``stmt`` reads as ``x = joint[k]``, if it is one."""
    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and stmt.lineno == stmt.end_lineno
            and isinstance(stmt.value, ast.Subscript) and isinstance(stmt.value.value, ast.Name)
            and stmt.value.value.id in found and isinstance(stmt.value.slice, ast.Constant)
            and stmt.value.slice.value in (0, 1, 2)):
        return stmt.value.value.id
    return None


def _read_by_index_or_deleted(stmt: ast.stmt, name: str, joint: ast.Assign) -> bool:
    """Return whether ``stmt``, which names the joint result ``name``, is its call, ``x = name[k]`` or a ``del``."""
    return (stmt is joint or _indexed_joint(stmt, {name: None}) is not None
            or (isinstance(stmt, ast.Delete) and all(isinstance(t, ast.Name) for t in stmt.targets)))


def _split_lines(stmt: ast.Assign, split: SplitCall, indent: str) -> list[str]:
    name, call = stmt.targets[0].id, stmt.value
    args = list(call.args)
    lines = []
    if split.copy_input:  # cuDNN's format for both parts, copied once as the joint call did
        lines += [_comment(indent, split.source + ".copy", "aten.clone"),
                  f"{indent}{_input_copy(name)} = torch.ops.aten.clone.default({ast.unparse(args[1])}, "
                  "memory_format=torch.channels_last)"]
        args[1] = ast.Name(_input_copy(name), ast.Load())
    for target, suffix, mask in ((name, ".input", (True, False, False)),
                                 (_weight(name), ".weight", (False, *split.mask[1:]))):
        part = ast.Call(call.func, [*args[:_MASK], ast.List([ast.Constant(m) for m in mask], ast.Load())], [])
        lines += [_comment(indent, split.source + suffix, "aten.convolution_backward"),
                  f"{indent}{target} = {ast.unparse(part)}"]
    if split.copy_input:
        lines.append(f"{indent}del {_input_copy(name)}")
    return lines


def _comment(indent: str, source: str, aten: str) -> str:
    return f"{indent}# Topologically Sorted Source Nodes: [{source}], Original ATen: [{aten}]"


def _weight(name: str) -> str:
    return f"{name}_weight_grad"


def _input_copy(name: str) -> str:
    return f"{name}_input_cl"

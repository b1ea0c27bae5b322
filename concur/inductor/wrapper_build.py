"""Build the rewritten ``call`` of an emission plan: a Python function in the wrapper's own namespace.

:func:`concur.inductor.wrapper_emit.plan_emission` says, as data, which
statement runs where and which stream switches, waits, records and
``record_stream`` protections go between them; :func:`build_call` turns
that into a function by assembling the wrapper's own statement nodes around
calls into a :class:`concur.streams.StreamRuntime` and compiling the result
in the wrapper's namespace, so the kernels, autotuned configs and constants
are the ones inductor already made. A failure inside the region aborts the
runtime (every side stream joined back) before it propagates.
"""

from __future__ import annotations

import ast
import copy
import itertools
import types
from typing import Any, Callable

from concur.inductor.wrapper_emit import KernelStreamPlan
from concur.inductor.wrapper_program import KernelProgram
from concur.streams import StreamRuntime

_counter = itertools.count()


def _located(node: ast.AST) -> ast.AST:
    """``node`` (made here, not the wrapper's) with a source position, so compile() takes it beside shared nodes."""
    node.lineno, node.col_offset, node.end_lineno, node.end_col_offset = 1, 0, 1, 0
    return node


def _shared(node: ast.stmt) -> ast.stmt:
    """A wrapper statement to put in an emitted call as it is; a copy given positions where it has none.

    Parsed statements have positions, and so do those concur makes for them
    (split ``del`` s, fresh allocations); one that has not would make
    compile() fail, so it is copied and located rather than changed in place.
    """
    if hasattr(node, "lineno"):
        return node
    return ast.fix_missing_locations(_located(copy.deepcopy(node)))


def build_call(program: KernelProgram, plan: KernelStreamPlan, namespace: dict,
               bound_to: Any = None) -> tuple[Callable, StreamRuntime]:
    """Return the rewritten ``call`` (a function in the wrapper's ``namespace``) and its stream runtime."""
    runtime = StreamRuntime(plan.num_streams, plan.num_events)
    rt_name = f"_concur_streams_{next(_counter)}"
    namespace[rt_name] = runtime
    unique = {ast.unparse(s.node): s.node for s in program.statements if s.kind == "stream"}
    stream_lookups = list(unique.values())  # inductor repeats ``stream0 = get_raw_stream(0)`` per kernel

    def rt(method: str, *args: ast.expr) -> ast.stmt:
        return ast.fix_missing_locations(_located(ast.Expr(ast.Call(
            func=ast.Attribute(value=ast.Name(rt_name, ast.Load()), attr=method, ctx=ast.Load()),
            args=list(args), keywords=[]))))

    def names(items) -> list[ast.expr]:
        return [ast.Name(n, ast.Load()) for n in items]

    # The region shares the wrapper's statement nodes instead of copying them (_shared): compile() only reads an
    # AST, and nothing below writes to a shared node. Deep copies made building a call cost as much as planning
    # it (experiments/emit_cost.py).
    region: list[ast.stmt] = [rt("fork", *names(program.inputs)), *stream_lookups]
    for step in plan.steps:
        if step.op == "stmt":
            region.append(_shared(step.statement.node))
        elif step.op == "switch":
            region.append(rt("switch", ast.Constant(step.index)))
            region += stream_lookups
        elif step.op in ("wait", "record"):
            region.append(rt(step.op, ast.Constant(step.index)))
        elif step.op == "protect":
            region.append(rt("protect", ast.Name(step.name, ast.Load()),
                             ast.Tuple([ast.Constant(i) for i in step.streams], ast.Load())))
    for name, streams in plan.protect_at_end:
        region.append(rt("protect", ast.Name(name, ast.Load()),
                         ast.Tuple([ast.Constant(i) for i in streams], ast.Load())))
    region.append(rt("join", *names(program.outputs)))
    handler = ast.fix_missing_locations(_located(ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()),
                                                                   name=None, body=[rt("abort"), ast.Raise()])))
    guarded = _located(ast.Try(body=region, handlers=[handler], orelse=[], finalbody=[]))

    # new containers on the path to the region, the wrapper's own nodes everywhere else
    fn = copy.copy(program.function)
    fn.name = f"{rt_name}_call"
    fn.decorator_list = []
    fn.body = list(fn.body)
    body = fn.body
    if program.guarded:
        at = next(i for i, s in enumerate(fn.body) if isinstance(s, ast.With))
        fn.body[at] = copy.copy(fn.body[at])
        fn.body[at].body = body = list(fn.body[at].body)
    body[program.start:program.end] = [guarded]
    module = ast.Module(body=[fn], type_ignores=[])
    exec(compile(module, f"<concur streams over {namespace.get('__file__', 'inductor output')}>", "exec"), namespace)
    call = namespace[fn.name]
    if bound_to is not None:
        call = types.MethodType(call, bound_to)
    return call, runtime

"""Walking Python syntax trees on the host: inductor's wrappers and the triton kernels they compile."""

from __future__ import annotations

import ast


def subnodes(node: ast.AST) -> list[ast.AST]:
    """``node`` and every node below it, as :func:`ast.walk` finds them but the contexts (``Load``, ``Store``).

    A list filled in one loop: a wrapper and its kernels are walked tens of
    thousands of times while a graph is placed, and ``ast.walk``'s nested
    generators cost about twice as much on the host.
    """
    found, i = [node], 0
    while i < len(found):
        for field in found[i]._fields:
            value = getattr(found[i], field, None)
            if isinstance(value, list):
                found += [x for x in value if isinstance(x, ast.AST) and not isinstance(x, ast.expr_context)]
            elif isinstance(value, ast.AST) and not isinstance(value, ast.expr_context):
                found.append(value)
        i += 1
    return found

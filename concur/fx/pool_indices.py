"""Max pooling that saves no indices, for the unfused path short of memory: backward recomputes them.

A max-pooling layer under autograd runs ``aten.max_pool2d_with_indices`` and
saves its input and the indices of each window's maximum, int64 the size of
its output: four times a bf16 output, and the input is saved beside them.
Where a 3x3 stride-1 pool reads an Inception block's whole input, the
indices are a large share of the memory alive at the start of backward, the
step's peak (inductor saves int8 offsets instead; the eager program saves
the indices; the figures are in ``experiments/RESULTS.md``). Where a
multi-stream program runs out of memory, its side streams holding blocks
only they may reuse, those bytes decide whether the streams fit.

:func:`max_pool2d` saves the input alone (which the plain layer saves too)
and recomputes the indices in backward, with the same aten op on the same
input: the same output and the same gradients, bit for bit, for one more
pooling kernel in backward. The rewrite (:func:`recompute_pool_indices`)
runs on the generated graph after scheduling, as the weight-gradient split
does: the replaced node reads and writes what the call did and runs on the
same stream, so the DAG, the schedule and the code's waits stay valid. What
the plan cannot know it checks at each call (grad mode, the input, saved-
tensor hooks), calling the plain layer when in doubt.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from concur import _torch_compat as compat
from concur.fx.call_checks import autograd_rewrite_applies

__all__ = ["max_pool2d", "pool_forward", "recompute_pool_indices"]

_Pair = tuple[int, int]


def _pair(value: Any) -> _Pair:
    return (value, value) if isinstance(value, int) else tuple(value)  # type: ignore[return-value]


class _RecomputedIndices(torch.autograd.Function):
    """``max_pool2d`` saving its input only; backward recomputes the indices and runs aten's own backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kernel: _Pair, stride: _Pair, padding: _Pair, dilation: _Pair,
                ceil_mode: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.pooling = (kernel, stride, padding, dilation, ceil_mode)
        # the op the plain layer runs under autograd: its indices are freed here, at the end of forward
        return torch.ops.aten.max_pool2d_with_indices(x, *ctx.pooling)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        indices = torch.ops.aten.max_pool2d_with_indices(x, *ctx.pooling)[1]
        return (torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *ctx.pooling, indices),
                None, None, None, None, None)


def _usable_now(x: Any) -> bool:
    """What the plan could not know: grad mode, the input (one that needs a gradient, batched or not), a trace or
    compile, saved-tensor hooks."""
    return autograd_rewrite_applies(x) and x.requires_grad and x.dim() in (3, 4)


def max_pool2d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False) -> Any:
    """``F.max_pool2d(x, ...)`` (no indices returned), saving no indices for backward where autograd records it."""
    if not _usable_now(x):
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode)
    kernel = _pair(kernel_size)
    steps = kernel if stride is None or (not isinstance(stride, int) and len(stride) == 0) else _pair(stride)
    return _RecomputedIndices.apply(x, kernel, steps, _pair(padding), _pair(dilation), bool(ceil_mode))


def _poolable(module: nn.Module) -> bool:
    """A plain ``nn.MaxPool2d`` that returns no indices and whose call is ``forward`` alone."""
    return (type(module) is nn.MaxPool2d and not module.return_indices and "forward" not in module.__dict__
            and not compat.module_call_runs_more_than_forward(module))


def pool_forward(module: nn.Module, x: Any) -> Any:
    """``module(x)`` for a planned ``nn.MaxPool2d``, saving no indices; its attributes are read now, and a module
    that stopped being a plain one since planning (hooks added, indices asked for) is called as it is."""
    if not _poolable(module):
        return module(x)
    return max_pool2d(x, module.kernel_size, module.stride, module.padding, module.dilation, module.ceil_mode)


def recompute_pool_indices(graph: fx.Graph, model: nn.Module) -> int:
    """Replace each plain ``nn.MaxPool2d`` call (and ``F.max_pool2d`` call without indices) of a generated graph
    by :func:`pool_forward` (:func:`max_pool2d`); return how many. The replaced node keeps its name, inputs,
    users and stream."""
    replaced = 0
    for node in list(graph.nodes):
        if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
            if not _poolable(model.get_submodule(str(node.target))):
                continue
            with graph.inserting_before(node):
                owner = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
            node.op, node.target, node.args = "call_function", pool_forward, (owner, node.args[0])
            replaced += 1
        elif node.op == "call_function" and node.target is F.max_pool2d and \
                not node.kwargs.get("return_indices", False) and len(node.args) <= 6:
            node.target = max_pool2d
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "return_indices"}
            replaced += 1
    if replaced:
        graph.lint()
    return replaced

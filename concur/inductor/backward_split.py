"""Weight gradients off the critical path of a backward aten graph.

Each convolution and linear layer's backward produces an input gradient,
which the next backward op waits for, and a weight gradient, which only the
optimizer needs. AOTAutograd emits a convolution's two as one
``convolution_backward`` call (one extern kernel launch): the weight part then
sits on the critical path, and no scheduler can move it. Split into two calls,
one per ``output_mask``, the input-gradient call stays on the path while the
weight(+bias) call becomes a leaf that a scheduler puts on a side stream
(out-of-order backprop, Oh et al., EuroSys'22). cuDNN and oneDNN compute the
two parts as separate kernels in either case, so the split adds a launch and
no arithmetic, and inductor fuses exactly what it fused before.

A linear layer's weight gradient is already its own ``mm``; both kinds are
recognised (:func:`weight_gradient_nodes`) by where their values go: only to
the graph's outputs, the gradients the optimizer reads.

One thing the joint call does that its input-gradient half would not: cuDNN
(ATen's ``cudnn_convolution_backward``) converts grad_output to the memory
format of ``input``, which the joint call first makes the convolution's
(``input.contiguous(channels_last)`` when the weight is channels-last, or
inductor's own copy). The input-gradient half skips that copy of ``input``,
so with a contiguous ``input`` (timm's ResNeSt: an avg-pool or a split sum
before a 1x1 convolution of a channels-last model) it converts grad_output to
contiguous and straight back, two full copies the wrapper never shows. The
split therefore makes that one copy of ``input`` itself, shared by both halves.

Where the split happens depends on the route: the stamped route splits the
graph before inductor compiles it (:func:`split_convolution_backward`), the
wrapper route compiles the joint calls and splits them only in the program
it puts on streams (:func:`split_calls` says how,
:mod:`concur.inductor.wrapper_split` does it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.fx as fx

from concur import _torch_compat as compat
from concur.dag.cost import Roofline
from concur.inductor.aten_dag import aten_cost, is_unpack, is_view

aten = torch.ops.aten

# convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
#                      output_padding, groups, output_mask)
_OUTPUT_MASK = 10

# Meta that names a node after the one it was traced from: two halves sharing it would be costed as one.
_NAMING_META = ("from_node",)


def split_convolution_backward(graph: fx.Graph) -> int:
    """Split every ``convolution_backward`` computing input and weight gradients into one call each.

    Returns the number of calls split. Masked-off outputs are not computed,
    so values and the gradients' layouts are those of the joint call.
    """
    split = len(_split_calls(graph))
    if split:
        graph.lint()
    return split


@dataclass(frozen=True)
class SplitCall:
    """How a multi-stream program splits one joint ``convolution_backward`` of a compiled graph.

    Found in inductor's wrapper by ``source`` (the name inductor lists above
    the call) and its ``output_mask``; ``costs`` are the predicted (µs,
    resource share) of the parts, under ``source`` + ``.input``, ``.weight``
    and, where the input is copied to channels-last for both (see the module
    docstring), ``.copy``.
    """

    source: str
    mask: tuple[bool, ...]
    copy_input: bool
    costs: Mapping[str, tuple[float, dict]]


def split_calls(graph: fx.Graph, roof: Roofline) -> dict[str, SplitCall]:
    """Return how :func:`split_convolution_backward` would split ``graph``'s calls, by source name.

    ``graph`` itself is unchanged: the split is made on a copy.

    The wrapper route compiles the joint calls (inductor's own program, the
    one a user gets without concur) and splits them only in the program it
    puts on several streams (:mod:`concur.inductor.wrapper_split`), so its
    one-stream program is never the split one.
    """
    scratch = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    scratch.graph_copy(graph, copies)
    joints = {copies[n]: n for n in graph.nodes if n in copies}
    found: dict[str, SplitCall] = {}
    for joint, mask, input_half, weight_half, copy in _split_calls(scratch):
        source = compat.inductor_source_name(joints[joint])
        parts = {".input": input_half, ".weight": weight_half, **({".copy": copy} if copy is not None else {})}
        costs = {}
        for suffix, node in parts.items():
            cost = aten_cost(node)
            costs[source + suffix] = (cost.microseconds(roof), cost.share(roof))
        found[source] = SplitCall(source, mask, copy is not None, costs)
    return found


def _split_calls(graph: fx.Graph) -> list[tuple[fx.Node, tuple[bool, ...], fx.Node, fx.Node, fx.Node | None]]:
    """Split the graph's joint calls in place; return (joint, its mask, input half, weight half, input copy) each.

    The joint nodes returned are out of the graph.
    """
    done = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.convolution_backward.default:
            continue
        if len(node.args) <= _OUTPUT_MASK or node.kwargs:
            continue
        mask = list(node.args[_OUTPUT_MASK])
        if not mask[0] or not (mask[1] or mask[2]):
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue  # the whole tuple is used (AOTAutograd never does this): leave the call whole
        head = node.args[:_OUTPUT_MASK]
        with graph.inserting_before(node):
            head = _input_in_backend_format(graph, head)
            input_grad = graph.call_function(node.target, (*head, [True, False, False]))
            weight_grad = graph.call_function(node.target, (*head, [False, mask[1], mask[2]]))
        value = node.meta.get("val")
        for half, keep in ((input_grad, (0,)), (weight_grad, (1, 2))):
            half.meta = {k: v for k, v in node.meta.items() if k not in _NAMING_META}
            if isinstance(value, (tuple, list)):
                half.meta["val"] = tuple(v if i in keep else None for i, v in enumerate(value))
        for user in list(node.users):
            user.replace_input_with(node, input_grad if user.args[1] == 0 else weight_grad)
        copy = head[1] if head[1] is not node.args[1] else None
        graph.erase_node(node)
        done.append((node, tuple(mask), input_grad, weight_grad, copy))
    return done


def _input_in_backend_format(graph: fx.Graph, head: tuple) -> tuple:
    """Return the call's arguments with ``input`` copied to channels-last where cuDNN would copy it.

    cuDNN's format is channels-last when input or weight is; a contiguous
    input of a channels-last weight is what the joint call copies once and
    what the input-gradient half alone would answer with two grad_output copies.
    """
    x, w = head[1], head[2]
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    wv = w.meta.get("val") if isinstance(w, fx.Node) else None
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)) or xv.dim() != 4 \
            or xv.device.type != "cuda":
        return head
    # the joint call's input.contiguous(channels_last) copies exactly when this is False
    if xv.is_contiguous(memory_format=torch.channels_last) or not compat.suggests_channels_last(wv):
        return head
    copy = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.channels_last})
    copy.meta = {"val": xv.clone(memory_format=torch.channels_last)}
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in x.meta:
            copy.meta[key] = x.meta[key]
    return (head[0], copy, *head[2:])


def _reaches_only_outputs(node: fx.Node) -> bool:
    users = list(node.users)
    return bool(users) and all(u.op == "output" or ((is_unpack(u) or is_view(u)) and _reaches_only_outputs(u))
                               for u in users)


def weight_gradient_nodes(graph: fx.Graph) -> set[str]:
    """Return the matmuls and convolution backward calls whose values reach only the graph's outputs.

    In a backward graph those outputs are the parameters' gradients, so these
    nodes are weight-gradient work: nothing else in the graph waits for them.
    """
    heavy = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution_backward.default)
    return {n.name for n in graph.nodes
            if n.op == "call_function" and n.target in heavy and _reaches_only_outputs(n)}

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
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from concur.inductor.aten_dag import is_unpack, is_view

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
    split = 0
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
            input_grad = graph.call_function(node.target, (*head, [True, False, False]))
            weight_grad = graph.call_function(node.target, (*head, [False, mask[1], mask[2]]))
        value = node.meta.get("val")
        for half, keep in ((input_grad, (0,)), (weight_grad, (1, 2))):
            half.meta = {k: v for k, v in node.meta.items() if k not in _NAMING_META}
            if isinstance(value, (tuple, list)):
                half.meta["val"] = tuple(v if i in keep else None for i, v in enumerate(value))
        for user in list(node.users):
            user.replace_input_with(node, input_grad if user.args[1] == 0 else weight_grad)
        graph.erase_node(node)
        split += 1
    if split:
        graph.lint()
    return split


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

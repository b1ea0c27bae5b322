"""Weight gradients off the critical path of backward, for the unfused path, through autograd itself.

A convolution's (or linear layer's) backward computes the input gradient,
which the next backward op waits for, and the weight gradient, which only the
optimizer needs. Autograd runs both in one node, on the stream the layer ran
on in forward, so the weight part sits on the critical path. Here each plain
``nn.Conv2d``/``nn.Linear`` call of a generated forward is recorded as three
autograd nodes instead of one::

    forward, on the node's stream i          backward
    y = conv(x, w.detach(), b.detach())      grad --> _Tie (i) --+--> conv's own node (i) --> grad of x
    t = _WeightGrad(w, b, y.detach())  (W)                       '--> _WeightGrad (W) --> AccumulateGrad w, b (W)
    y = _Tie(y, t, x)  (y marked changed)

``t`` and the returned ``y`` are aliases, so forward runs the same kernels as
before and nothing on W. Autograd does all the rest, as for any node:
_WeightGrad's backward runs on W, the stream current when it was recorded,
after W waits for the gradient (an event); the weights' AccumulateGrad nodes,
recorded on W too, run there; and the engine makes the stream that called
``backward`` wait for every such leaf stream before backward returns (Note
[Streaming backwards], ``GraphTask::exec_post_processing`` in
torch/csrc/autograd/engine.cpp). Tensor and post-accumulate-grad hooks, DDP's
reducer, ``torch.autograd.grad`` w.r.t. weights, accumulation and
``create_graph`` all see ordinary autograd.

Why ``_Tie`` changes ``y`` in place (``mark_dirty``, no kernel): a custom
Function's output that aliases an input is a view autograd forbids to modify
in place afterwards, and a ReLU(inplace=True) often follows a convolution.
Why ``x`` reaches _WeightGrad outside its inputs: an input edge to ``x``'s
history would make the engine run the node (and its kernels on W, never
joined) for gradients w.r.t. ``x`` alone; it is still saved with
``save_for_backward`` (version checks, and double backward through ``x``).
Why ``x`` is an input of ``_Tie``: under ``create_graph`` the input gradient
must depend on ``w``, which the layer's own node never saw, so ``_Tie``
computes it there instead (a second backward through a gradient penalty).

The rewrite (:func:`split_weight_gradients`) runs on the generated graph,
after scheduling: the replaced node reads and writes what the module call did
and runs on the same stream, so the DAG, the schedule and the code's waits
stay valid. What it cannot see at plan time it checks at each call
(:func:`split_forward` calls the module itself when in doubt).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from concur import _torch_compat as compat
from concur.fx.call_checks import autograd_rewrite_applies
from concur.streams import StreamRuntime

SPLIT_TYPES = (nn.Conv2d, nn.Linear)


@dataclass(frozen=True)
class _Conv:
    """The geometry of one convolution; computes its weight (and bias) gradient."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def gradients(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight.dtype != grad.dtype:  # autocast: the kernel ran on a cast weight of this layout
            weight = torch.empty_like(weight, dtype=grad.dtype)
        # With the input gradient masked off, only the weight's shape and layout are read.
        _, weight_grad, bias_grad = torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if with_bias else None, self.stride, self.padding,
            self.dilation, False, [0] * len(self.stride), self.groups, [False, True, with_bias])
        return weight_grad, bias_grad

    def input_gradient(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.convolution_backward(
            grad, x, weight.to(grad.dtype), None, self.stride, self.padding, self.dilation, False,
            [0] * len(self.stride), self.groups, [True, False, False])[0]


@dataclass(frozen=True)
class _Linear:
    """A linear layer on 2-d inputs; computes its weight (and bias) gradient as autograd's addmm/mm would."""

    def gradients(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return grad.t().mm(x), grad.sum(0) if with_bias else None

    def input_gradient(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grad.mm(weight.to(grad.dtype))


class _WeightGrad(torch.autograd.Function):
    """Returns ``y`` (an alias); its backward turns ``y``'s gradient into the weight and bias gradients."""

    @staticmethod
    def forward(ctx, weight, bias, y, layer_and_x):
        layer, x = layer_and_x
        ctx.layer = layer
        ctx.weight = weight.detach()  # shape, layout and dtype; its values are never read
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if grad.is_cuda:
            # Both were allocated on forward streams and are read here, on the weight-gradient
            # stream: the caching allocator must not give their memory back to those streams
            # before this stream's kernels that read them are done.
            stream = torch.cuda.current_stream(grad.device)
            grad.record_stream(stream)
            x.record_stream(stream)
        if x.dtype != grad.dtype:  # autocast ran the layer in grad's dtype: so does its weight gradient
            x = x.to(grad.dtype)
        with_bias = ctx.needs_input_grad[1]
        weight_grad, bias_grad = ctx.layer.gradients(grad, x, ctx.weight, with_bias)
        weight_grad = weight_grad.to(ctx.weight.dtype)
        bias_grad = bias_grad.to(ctx.bias_dtype) if with_bias else None
        return weight_grad, bias_grad, None, None


class _Tie(torch.autograd.Function):
    """Returns ``y`` itself, marked changed; its backward hands ``y``'s gradient to both ``y`` and ``t``.

    Under ``create_graph`` it computes the input gradient itself, from the
    weight, and hands ``y`` nothing: the layer's own node ran on a detached
    weight, so its input gradient would not depend on the weight in a second
    backward, and the gradient penalty's terms through it would be lost.
    """

    @staticmethod
    def forward(ctx, y, t, x, layer_and_weight):
        layer, weight = layer_and_weight
        ctx.layer = layer
        ctx.save_for_backward(x, weight)  # read only under create_graph
        ctx.mark_dirty(y)  # no kernel: y's history is rebased onto this node, y stays a base tensor
        return y

    @staticmethod
    def backward(ctx, grad):
        if not torch.is_grad_enabled():  # the engine enables grad mode in backward for create_graph only
            return grad, grad, None, None
        x, weight = ctx.saved_tensors
        input_grad = ctx.layer.input_gradient(grad, x, weight) if ctx.needs_input_grad[2] else None
        return None, grad, input_grad, None


def conv_padding(conv: nn.Conv2d) -> tuple[int, ...] | None:
    """Return the convolution's padding as numbers per side, or None if it pads unevenly ("same", even kernel)."""
    if not isinstance(conv.padding, str):
        return tuple(conv.padding)
    if conv.padding == "valid":
        return (0,) * len(conv.kernel_size)
    total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
    return tuple(t // 2 for t in total) if all(t % 2 == 0 for t in total) else None


def splittable(module: nn.Module) -> bool:
    """Return True if ``module`` is a plain Conv2d or Linear whose call is ``forward`` alone."""
    if type(module) not in SPLIT_TYPES or "forward" in module.__dict__:
        return False
    if isinstance(module, nn.Conv2d) and (module.padding_mode != "zeros" or conv_padding(module) is None):
        return False
    return not compat.module_call_runs_more_than_forward(module)


def _leaf(p: Any) -> bool:
    return type(p) in (torch.Tensor, nn.Parameter) and p.is_leaf


def _usable_now(module: nn.Module, x: Any) -> bool:
    """What the plan could not know: grad mode, which weights train, hooks added since, the input."""
    if not autograd_rewrite_applies(x):
        return False
    # An input that needs no gradient (a network's stem reads the batch) leaves the layer's backward its weight
    # gradient alone, last in backward, with no input gradient on the caller's stream to overlap. Split off, it
    # would only move to the weight-gradient stream, and that stream would allocate the layer's cuDNN workspace
    # of its own: a stem's is the largest (GoogLeNet b64: 56 MiB), and where it does not fit, cuDNN keeps a slower
    # algorithm for the process (4 ms a step instead of 0.2).
    if not x.requires_grad:
        return False
    if not (x.dim() == 4 if isinstance(module, nn.Conv2d) else x.dim() >= 2):  # batched inputs only
        return False
    weight, bias = module.weight, module.bias
    if not (_leaf(weight) and weight.requires_grad and (bias is None or _leaf(bias))):
        return False
    return splittable(module)


def _as_computed(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` in the dtype autocast runs conv2d and linear in (both are on its lower-precision list).

    Cast here once, instead of inside the layer's autocast dispatch, so the
    weight gradient reads the very tensor the layer read; float64 is never cast.
    """
    kind = x.device.type
    if x.dtype != torch.float64 and torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


def split_forward(module: nn.Module, x: Any, runtime: StreamRuntime) -> Any:
    """Return ``module(x)``, recorded so that its weight (and bias) gradient runs on the weight-gradient stream.

    Calls ``module(x)`` unchanged when the split does not apply to this call
    (grad mode off, a frozen or non-leaf weight, hooks added after planning,
    saved-tensor hooks, another input rank or device).
    """
    if not _usable_now(module, x):
        return module(x)
    weight, bias = module.weight, module.bias
    bias_value = None if bias is None else bias.detach()
    x = _as_computed(x)
    if isinstance(module, nn.Conv2d):
        layer: _Conv | _Linear = _Conv(tuple(module.stride), conv_padding(module), tuple(module.dilation),
                                       module.groups)
        saved = x
        y = F.conv2d(x, weight.detach(), bias_value, layer.stride, layer.padding, layer.dilation, layer.groups)
    else:
        # On 2-d rows, so that y comes out of addmm/mm as a base tensor, never a view (see _Tie).
        layer, saved = _Linear(), x.flatten(0, -2) if x.dim() > 2 else x
        y = F.linear(saved, weight.detach(), bias_value)
    with runtime.on_weight_grad_stream():
        t = _WeightGrad.apply(weight, bias, y.detach(), (layer, saved))
    y = _Tie.apply(y, t, saved, (layer, weight))
    return y.unflatten(0, x.shape[:-1]) if isinstance(layer, _Linear) and x.dim() > 2 else y


def split_weight_gradients(graph: fx.Graph, model: nn.Module, runtime_attr: str) -> int:
    """Replace each splittable Conv2d/Linear call in a generated graph by :func:`split_forward`; return how many.

    Fails closed: a module called more than once, or whose weight or bias is
    shared with another module or read by the graph directly, keeps its call.
    The replaced node keeps its name, inputs, users and stream.
    """
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    read_directly = {id(_attribute(model, str(n.target))) for n in graph.nodes if n.op == "get_attr"}
    runtime = next(n for n in graph.nodes if n.op == "get_attr" and n.target == runtime_attr)
    split = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or calls[node.target] != 1 or len(node.args) != 1 or node.kwargs:
            continue
        module = model.get_submodule(str(node.target))
        if not splittable(module):
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if any(uses[id(p)] != 1 or id(p) in read_directly for p in params):
            continue
        with graph.inserting_before(node):
            owner = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
        node.op, node.target, node.args = "call_function", split_forward, (owner, node.args[0], runtime)
        split += 1
    if split:
        graph.lint()
    return split


def _attribute(model: nn.Module, path: str) -> Any:
    value: Any = model
    for atom in path.split("."):
        value = getattr(value, atom, None)
    return value

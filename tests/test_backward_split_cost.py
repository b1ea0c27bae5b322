"""What splitting a convolution's backward costs beyond one more launch (concur.inductor.backward_split).

cuDNN's ``convolution_backward`` converts grad_output to ``input``'s memory
format. The joint call copies a contiguous ``input`` of a channels-last
convolution to channels-last first; an input-gradient half on its own would
not, and would convert grad_output to contiguous and back (two copies per
call that no wrapper shows; timm's ResNeSt-14d has four such convolutions:
1x1 convolutions after an avg-pool or a split sum, which inductor's forward
leaves contiguous). These tests hold the split to the joint call's layouts.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from concur.inductor.backward_split import split_convolution_backward

aten = torch.ops.aten
CL = torch.channels_last


def _backward_graph(input_format: torch.memory_format, device: str = "cuda") -> fx.Graph:
    """One channels-last 1x1 convolution's backward whose saved input has ``input_format``."""
    with FakeTensorMode():
        go = torch.empty(2, 16, 7, 7, device=device, dtype=torch.bfloat16).to(memory_format=CL)
        x = torch.empty(2, 8, 7, 7, device=device, dtype=torch.bfloat16).to(memory_format=input_format)
        w = torch.empty(16, 8, 1, 1, device=device, dtype=torch.bfloat16).to(memory_format=CL)
        vals = aten.convolution_backward.default(go, x, w, [0], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                 [True, True, False])
    g = fx.Graph()
    nodes = []
    for name, v in (("grad_output", go), ("x", x), ("w", w)):
        n = g.placeholder(name)
        n.meta["val"] = v
        nodes.append(n)
    call = g.call_function(aten.convolution_backward.default,
                           (*nodes, [0], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False]))
    call.meta["val"] = vals
    dx = g.call_function(operator.getitem, (call, 0))
    dw = g.call_function(operator.getitem, (call, 1))
    g.output((dx, dw))
    return g


def _halves(g: fx.Graph) -> list[fx.Node]:
    return [n for n in g.nodes if n.target is aten.convolution_backward.default]


def test_the_input_gradient_half_gets_the_input_in_the_weights_channels_last_format():
    g = _backward_graph(torch.contiguous_format)
    assert split_convolution_backward(g) == 1
    dx, dw = _halves(g)
    assert list(dx.args[10]) == [True, False, False]
    for half in (dx, dw):  # one copy, shared: the joint call's one conversion of the input
        assert half.args[1] is dx.args[1]
        assert half.args[1].meta["val"].is_contiguous(memory_format=CL)
    assert sum(n.target is aten.clone.default for n in g.nodes) == 1


def test_an_input_already_channels_last_is_not_copied():
    g = _backward_graph(CL)
    split_convolution_backward(g)
    assert not any(n.target is aten.clone.default for n in g.nodes)
    assert all(h.args[1].op == "placeholder" for h in _halves(g))


def test_cpu_convolutions_are_left_as_they_are():
    g = _backward_graph(torch.contiguous_format, device="cpu")
    split_convolution_backward(g)
    assert not any(n.target is aten.clone.default for n in g.nodes)


def test_an_input_of_one_pixel_is_channels_last_already_and_not_copied():
    # (N, C, 1, 1) squeeze-excite inputs: contiguous in both formats, so the joint call copies nothing either
    g = _backward_graph(torch.contiguous_format)
    x = next(n for n in g.nodes if n.name == "x")
    x.meta["val"] = x.meta["val"][:, :, :1, :1].contiguous()
    split_convolution_backward(g)
    assert not any(n.target is aten.clone.default for n in g.nodes)

"""Weight gradients off the critical path (concur.inductor.backward_split): the split keeps values and
fusion, and puts the weight parts of a chain's backward beside its input-gradient path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch.utils._python_dispatch import TorchDispatchMode

import concur
from concur.dag.cost import Roofline
from concur.inductor.backward_split import split_convolution_backward, weight_gradient_nodes
from tests.test_backend import compare_compiled, forward_and_backward, fresh_dynamo  # noqa: F401 - autouse

pytestmark = pytest.mark.inductor  # compiles through inductor: CI runs it as its own tier

aten = torch.ops.aten

# Kernels far from filling the device and a launch worth a few of them: where a side stream pays.
LAUNCH_LIGHT = Roofline("launch-light", flops_per_us=1e6, bytes_per_us=1e5, kernel_overhead_us=5.0)


class ConvChain(nn.Module):
    """Six 3x3 convolutions in a chain and a linear head: no branch at all in the forward."""

    def __init__(self, c: int = 16, n: int = 6):
        super().__init__()
        self.convs = nn.Sequential(*[nn.Sequential(nn.Conv2d(c if i else 3, c, 3, padding=1), nn.ReLU())
                                     for i in range(n)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        return self.head(self.convs(x).mean((2, 3)))


def backward_graph(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list]:
    """AOTAutograd's backward graph of ``model`` and the inputs it was first called with."""
    captured: list = []

    def record(gm, example_inputs):
        captured.append(gm)

        def run(*args):
            captured.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            return gm(*args)
        return make_boxed_func(run)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, e: make_boxed_func(g.forward),
                                     bw_compiler=record)

    torch.compile(model, backend=backend)(x).sum().backward()
    return captured[0], captured[1]


def conv_backward_masks(graph: torch.fx.Graph) -> list[tuple[bool, ...]]:
    return [tuple(n.args[10]) for n in graph.nodes if n.target is aten.convolution_backward.default]


def test_split_gives_one_call_per_part_and_the_same_gradients():
    torch.manual_seed(0)
    gm, inputs = backward_graph(ConvChain(), torch.randn(2, 3, 8, 8))
    expected = gm(*inputs)
    before = conv_backward_masks(gm.graph)
    # the first convolution's input needs no gradient: AOTAutograd already computes its weight part alone
    assert before.count((True, True, True)) == 5 and before.count((False, True, True)) == 1
    assert split_convolution_backward(gm.graph) == 5
    gm.recompile()
    after = conv_backward_masks(gm.graph)
    assert sorted(after) == sorted([(True, False, False)] * 5 + [(False, True, True)] * 6)
    for a, e in zip(gm(*inputs), expected, strict=True):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert split_convolution_backward(gm.graph) == 0  # nothing left to split


def test_split_halves_carry_their_own_values_and_no_shared_source_name():
    torch.manual_seed(0)
    gm, _ = backward_graph(ConvChain(n=2), torch.randn(2, 3, 8, 8))
    joint = next(n for n in gm.graph.nodes if n.target is aten.convolution_backward.default and n.args[10][0])
    joint.meta["from_node"] = ["a dynamo node"]  # as a forward graph's nodes carry: both halves would share it
    head, (grad_input, grad_weight, grad_bias) = joint.args[:10], joint.meta["val"]
    assert split_convolution_backward(gm.graph) == 1
    halves = [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default and n.args[:10] == head]
    assert [list(n.args[10]) for n in halves] == [[True, False, False], [False, True, True]]
    assert halves[0].meta["val"] == (grad_input, None, None)
    assert halves[1].meta["val"] == (None, grad_weight, grad_bias)
    assert all("from_node" not in n.meta for n in halves)


def test_linear_and_convolution_weight_gradients_are_recognised():
    torch.manual_seed(0)
    gm, _ = backward_graph(ConvChain(), torch.randn(2, 3, 8, 8))
    split_convolution_backward(gm.graph)
    found = weight_gradient_nodes(gm.graph)
    targets = sorted(str(gm.graph.find_nodes(op="call_function", target=t)[0].target)
                     for t in {n.target for n in gm.graph.nodes if n.name in found})
    assert targets == ["aten.convolution_backward.default", "aten.mm.default"]
    by_target = {n.name: n for n in gm.graph.nodes if n.name in found}
    assert sum(1 for n in by_target.values() if n.target is aten.mm.default) == 1  # the head's weight, not its input
    assert sum(1 for n in by_target.values() if n.target is aten.convolution_backward.default) == 6
    assert all(not n.args[10][0] for n in by_target.values() if n.target is aten.convolution_backward.default)


@pytest.mark.parametrize("split", [False, True])
def test_a_chain_trains_as_eager_and_its_weight_gradients_leave_the_critical_path(split):
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=LAUNCH_LIGHT, split_weight_grads=split)
    compare_compiled(ConvChain(), lambda: torch.randn(8, 3, 16, 16), backend, steps=2)
    _, bw = forward_and_backward(backend.graphs)
    assert bw.fallback_reason is None, bw
    if split:
        assert bw.convolutions_split == 5 and bw.weight_grad_ops == 7, bw
        assert bw.num_streams > 1 and bw.num_waits > 0 and bw.predicted_speedup > 1.1, bw
    else:  # joint calls: the backward of a chain is a chain
        assert bw.convolutions_split == 0 and bw.num_streams == 1, bw


def test_the_split_adds_one_launch_per_convolution_and_changes_no_fused_kernel():
    launches = {}
    for split in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend = concur.backend(streams=4, roofline=LAUNCH_LIGHT, split_weight_grads=split)
        torch.compile(ConvChain(), backend=backend)(torch.randn(8, 3, 16, 16)).sum().backward()
        _, bw = forward_and_backward(backend.graphs)
        launches[split] = bw.num_launches, bw.convolutions_split
    (joint, _), (split_launches, split) = launches[False], launches[True]
    assert split == 5 and split_launches == joint + split, launches


class _ConvolutionBackwardMasks(TorchDispatchMode):
    """Record the output_mask of every convolution_backward run (not those of the cost model's meta tensors)."""

    def __init__(self):
        super().__init__()
        self.masks: list[tuple[bool, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.convolution_backward.default and args[0].device.type != "meta":
            self.masks.append(tuple(args[10]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep", [True, False])
def test_only_a_plan_on_several_streams_runs_the_split_calls(keep):
    # A backward whose plan is dropped runs inductor's own program, the one torch.compile alone gives (and the
    # one a measured plan is weighed against): its convolution backward calls stay joint
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=LAUNCH_LIGHT, min_predicted_speedup=1.0 if keep else 1e9)
    compiled = torch.compile(ConvChain(), backend=backend)
    x = torch.randn(8, 3, 16, 16)
    loss = compiled(x).sum()
    with _ConvolutionBackwardMasks() as seen:
        loss.backward()
    _, bw = forward_and_backward(backend.graphs)
    if keep:
        assert bw.num_streams > 1 and bw.convolutions_split == 5 and bw.weight_grad_ops == 7, bw
        assert sorted(seen.masks) == sorted([(True, False, False)] * 5 + [(False, True, True)] * 6)
    else:
        assert bw.num_streams == 1 and bw.convolutions_split == 0 and bw.weight_grad_ops == 2, bw
        assert sorted(seen.masks) == sorted([(True, True, True)] * 5 + [(False, True, True)])

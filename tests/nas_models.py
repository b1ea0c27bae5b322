"""A NASNet-style cell network whose candidate operations hold Python control flow fx cannot trace.

Each cell combines two previous states through ``NODES`` intermediate nodes;
every node adds two operations applied to earlier states, and the cell
concatenates its nodes. The operations are independent branches, so they can
run concurrently, but several contain control flow on tensor *values* or
*shapes*, which torch.fx cannot trace:

- ``GatedSepConv``: ``if x.mean() > 0`` chooses between two convolutions;
- ``RepeatedConv``: repeats a convolution a data-dependent number of times
  (``int(...)`` of a tensor);
- ``FactorizedReduce``: pads odd spatial sizes (``if x.shape[-1] % 2``).

With ``leaf_modules="auto"`` concur keeps these operations whole and traces
the cells around them, so the branches of a cell still run on several streams.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def relu_conv_bn(cin: int, cout: int, k: int = 1, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class GatedSepConv(nn.Module):
    """Separable convolution whose kernel depends on the sign of the input's mean."""

    def __init__(self, c: int, stride: int = 1):
        super().__init__()
        self.small = nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False)
        self.large = nn.Conv2d(c, c, 5, stride, 2, groups=c, bias=False)
        self.point = nn.Conv2d(c, c, 1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        x = F.relu(x)
        if x.mean() > 0.4:  # data-dependent branch: fx cannot trace it
            x = self.large(x)
        else:
            x = self.small(x)
        return self.bn(self.point(x))


class RepeatedConv(nn.Module):
    """A convolution applied 1 to ``max_repeats`` times, as many as the input's scale asks."""

    def __init__(self, c: int, stride: int = 1, max_repeats: int = 3):
        super().__init__()
        self.first = relu_conv_bn(c, c, 3, stride)
        self.again = relu_conv_bn(c, c, 3)
        self.max_repeats = max_repeats

    def forward(self, x):
        x = self.first(x)
        repeats = int(x.detach().abs().mean().clamp(max=self.max_repeats - 1))  # data-dependent count
        for _ in range(repeats):
            x = x + self.again(x)
        return x


class FactorizedReduce(nn.Module):
    """Halve the spatial size with two offset 1x1 convolutions; pad odd sizes first."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.a = nn.Conv2d(cin, cout // 2, 1, 2, bias=False)
        self.b = nn.Conv2d(cin, cout - cout // 2, 1, 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(x)
        if x.shape[-1] % 2 == 1:  # shape-dependent branch: fx's proxy shapes cannot decide it
            x = F.pad(x, (0, 1, 0, 1))
        return self.bn(torch.cat([self.a(x), self.b(x[:, :, 1:, 1:])], dim=1))


class Pool(nn.Module):
    """Max or average 3x3 pooling (traceable: a cell mixes traceable and opaque operations)."""

    def __init__(self, kind: str, stride: int = 1):
        super().__init__()
        self.pool = (nn.MaxPool2d if kind == "max" else nn.AvgPool2d)(3, stride, 1)

    def forward(self, x):
        return self.pool(x)


# (operation, input state) pairs per node: NASNet-A-like, two per node.
NORMAL = [(("sep", 0), ("rep", 1)), (("sep", 1), ("max", 0)), (("avg", 2), ("sep", 1)), (("rep", 0), ("avg", 3))]
REDUCE = [(("sep", 0), ("rep", 1)), (("max", 1), ("sep", 0)), (("avg", 2), ("rep", 1)), (("sep", 3), ("max", 2))]


def make_op(kind: str, c: int, stride: int) -> nn.Module:
    if kind == "sep":
        return GatedSepConv(c, stride)
    if kind == "rep":
        return RepeatedConv(c, stride)
    return Pool(kind, stride)


class Cell(nn.Module):
    """A NASNet-style cell: two preprocessed inputs, four nodes of two ops each, concatenated."""

    def __init__(self, c_prev_prev: int, c_prev: int, c: int, reduction: bool, reduction_prev: bool):
        super().__init__()
        self.pre0 = FactorizedReduce(c_prev_prev, c) if reduction_prev else relu_conv_bn(c_prev_prev, c)
        self.pre1 = relu_conv_bn(c_prev, c)
        genotype = REDUCE if reduction else NORMAL
        self.inputs = [[i for _, i in pair] for pair in genotype]
        # ops reading a cell input (states 0 and 1) stride 2 in a reduction cell
        self.ops = nn.ModuleList(
            nn.ModuleList(make_op(kind, c, 2 if reduction and i < 2 else 1) for kind, i in pair)
            for pair in genotype)
        self.out_channels = c * len(genotype)

    def forward(self, s0, s1):
        states = [self.pre0(s0), self.pre1(s1)]
        for (op_a, op_b), (i, j) in zip(self.ops, self.inputs):
            states.append(op_a(states[i]) + op_b(states[j]))
        return torch.cat(states[2:], dim=1)


class NASNetStyle(nn.Module):
    """Stem, then normal and reduction cells (NASNet layout), global pool and a classifier."""

    def __init__(self, c: int = 8, layout: str = "NRNR", num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c))
        c_pp, c_p, reduction_prev = 2 * c, 2 * c, False
        cells = []
        for kind in layout:
            reduction = kind == "R"
            if reduction:
                c *= 2
            cell = Cell(c_pp, c_p, c, reduction, reduction_prev)
            cells.append(cell)
            c_pp, c_p, reduction_prev = c_p, cell.out_channels, reduction
        self.cells = nn.ModuleList(cells)
        self.head = nn.Linear(c_p, num_classes)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.head(F.adaptive_avg_pool2d(F.relu(s1), 1).flatten(1))

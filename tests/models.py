"""Small synthetic models, one per kind of hazard or structure the pipeline must get right."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class InplaceHazard(nn.Module):
    """A cheap branch reads ``a`` before a heavy in-place chain overwrites it.

    Without the write-after-read edge a list scheduler issues the heavy
    in-place chain first (it has the longer path) and the cheap branch reads
    the overwritten values.
    """

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.heavy = nn.Sequential(*[nn.Conv2d(8, 8, 3, padding=1) for _ in range(3)])

    def forward(self, x):
        a = self.stem(x)
        cheap = a * 2.0               # reads a before the in-place ops
        a.mul_(0.5)                   # method with trailing underscore
        a += 1.0                      # augmented assignment
        F.relu(a, inplace=True)       # inplace=True functional (last: relu saves its output)
        heavy = self.heavy(a)
        return cheap.sum(dim=1, keepdim=True) + heavy


class BufferMutation(nn.Module):
    """Buffers updated in place during forward, one update with no users (must not be dropped)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.conv(x)
        before = y + self.ema.view(1, -1, 1, 1)          # reads ema before the update
        self.calls.add_(1)                               # result unused: must survive DCE
        self.ema.mul_(0.9).add_(y.mean(dim=(0, 2, 3)).detach() * 0.1)
        after = y + 2 * self.ema.view(1, -1, 1, 1)       # reads ema after the update
        return before + after


class MultiInputDict(nn.Module):
    """Two inputs, a dict output holding a tensor and a tuple."""

    def __init__(self):
        super().__init__()
        self.a = conv_bn(3, 6)
        self.b = conv_bn(5, 6)
        self.head = nn.Linear(12, 3)

    def forward(self, x, y):
        fa = self.a(x).mean(dim=(2, 3))
        fb = self.b(y).mean(dim=(2, 3))
        logits = self.head(torch.cat([fa, fb], dim=1))
        return {"logits": logits, "features": (fa, fb)}


class WideNet(nn.Module):
    """``branches`` parallel conv-BN-ReLU towers of different depths, concatenated."""

    def __init__(self, branches: int = 10, channels: int = 8):
        super().__init__()
        self.stem = conv_bn(3, channels)
        self.towers = nn.ModuleList(
            nn.Sequential(*[conv_bn(channels, channels) for _ in range(1 + i % 3)]) for i in range(branches))
        self.head = nn.Linear(branches * channels, 10)

    def forward(self, x):
        s = self.stem(x)
        y = torch.cat([t(s) for t in self.towers], dim=1)
        return self.head(F.adaptive_avg_pool2d(y, 1).flatten(1))


class ViewAlias(nn.Module):
    """An in-place op through a view must be ordered against readers of the base tensor."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.slow = nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(3)])

    def forward(self, x):
        a = self.stem(x)
        reader = a.sum(dim=1)                  # reads the base
        flat = a.view(a.shape[0], -1)          # view of a
        flat.narrow(1, 0, 3).zero_()           # writes through a view of the view
        flat.mul_(3.0)
        return reader.mean() + self.slow(a).mean()


class SharedBatchNorm(nn.Module):
    """One BatchNorm applied in two branches: its running stats are updated twice, in order."""

    def __init__(self):
        super().__init__()
        self.left = nn.Conv2d(3, 6, 3, padding=1)
        self.right = nn.Conv2d(3, 6, 1)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn(self.left(x)) + self.bn(self.right(x) * 2.0)


class DropoutBranches(nn.Module):
    """Random draws in several branches: a seeded run must draw them in the original order."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)) for _ in range(4))

    def forward(self, x):
        outs = [b(x) for b in self.branches]
        noise = torch.rand_like(x)
        return torch.stack(outs).sum(0) + F.dropout(noise, 0.3, training=self.training)


class DataDependentBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


class Untraceable(nn.Module):
    """Control flow on tensor values inside a submodule: fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = DataDependentBlock()
        self.other = nn.Linear(4, 4)

    def forward(self, x):
        h = self.pre(x)
        return self.block(h) + self.other(h)


SYNTHETIC = {
    "inplace_hazard": (InplaceHazard, lambda: (torch.randn(2, 3, 8, 8),)),
    "buffer_mutation": (BufferMutation, lambda: (torch.randn(2, 3, 8, 8),)),
    "multi_input_dict": (MultiInputDict, lambda: (torch.randn(2, 3, 8, 8), torch.randn(2, 5, 8, 8))),
    "wide": (WideNet, lambda: (torch.randn(2, 3, 8, 8),)),
    "view_alias": (ViewAlias, lambda: (torch.randn(2, 3, 8, 8),)),
    "shared_bn": (SharedBatchNorm, lambda: (torch.randn(2, 3, 8, 8),)),
    "dropout": (DropoutBranches, lambda: (torch.randn(4, 16),)),
}


class Towers(nn.Module):
    """Towers of ``widths`` on a shared stem of ``stem_width``, joined by a head: as many independent branches as
    widths (plans on 2, 3 and 4 streams differ for four). A wide tower saves large activations for backward
    (its Linear's output and its Tanh's), a narrow one small ones."""

    def __init__(self, stem_width: int, widths: tuple[int, ...]):
        super().__init__()
        self.stem = nn.Linear(6, stem_width)
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(stem_width, width), nn.Tanh(),
                                                  nn.Linear(width, stem_width)) for width in widths)
        self.head = nn.Linear(stem_width * len(widths), 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.head(torch.cat([t(h) for t in self.towers], dim=1))

"""Models of the experiment sweep, by name: each builder returns ``(model, image_size)``.

    googlenet, inception_v3, resnet50   torchvision, without auxiliary heads or their initialisation
    branchy:<branches>x<width>          synthetic Inception-like net: ``branches`` (1..16) parallel
                                        conv branches of ``width`` channels per block
    nascell[:<width>]                   NASNet/DARTS-style cells with a fixed genotype (no
                                        data-dependent control flow, so fx traces it whole)
    torchvision:NAME, timm:NAME         any model of concur.zoo, at the input size it is made for

The synthetic nets exist to vary one thing at a time: how many independent
branches a block offers, and how much work each branch is. A block is

::

    x ──┬── conv-bn-relu ── conv-bn-relu ──┐
        ├── ...            (branches)      ├── cat ── 1x1 conv ── + x
        └── conv-bn-relu ── conv-bn-relu ──┘

so the DAG's width inside a block is exactly ``branches``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn



def _torchvision(name: str, **kwargs) -> nn.Module:
    import torchvision  # here, not at the top: the synthetic nets need no torchvision

    return getattr(torchvision.models, name)(weights=None, **kwargs)


# no auxiliary heads and no custom initialisation: the step times the network, not torchvision's extras
TORCHVISION_MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "googlenet": (lambda: _torchvision("googlenet", aux_logits=False, init_weights=False), 224),
    "inception_v3": (lambda: _torchvision("inception_v3", aux_logits=False, init_weights=False), 299),
    "resnet50": (lambda: _torchvision("resnet50"), 224),
}


def _timm(name: str) -> nn.Module:
    """A randomly initialised timm model, built without concur (the recipe's processes must not load it)."""
    try:
        import timm
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"timm not installed: {name} is a timm model (pip install timm)") from exc
    return timm.create_model(name, pretrained=False)


# timm networks the memory benchmark names bare, at their input size
TIMM_MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "hrnet_w18_small": (lambda: _timm("hrnet_w18_small"), 224),
}

NUM_CLASSES = 1000  # the same head as torchvision's, so one loss and one target shape fit all


def conv_bn_relu(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=False))


class BranchyBlock(nn.Module):
    """``branches`` independent two-conv branches, concatenated, projected back, plus the input."""

    def __init__(self, width: int, branches: int):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(conv_bn_relu(width, width), conv_bn_relu(width, width)) for _ in range(branches))
        self.project = nn.Conv2d(width * branches, width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [b(x) for b in self.branches]
        return x + self.project(torch.cat(outs, 1) if len(outs) > 1 else outs[0])


class BranchyNet(nn.Module):
    """Stem, ``blocks`` :class:`BranchyBlock` s, global pooling and a linear head."""

    def __init__(self, branches: int, width: int, blocks: int = 3, num_classes: int = NUM_CLASSES):
        super().__init__()
        if not 1 <= branches <= 16:
            raise ValueError(f"branchy: branches must be 1..16, got {branches}")
        self.stem = conv_bn_relu(3, width, 3, stride=2)
        self.blocks = nn.Sequential(*(BranchyBlock(width, branches) for _ in range(blocks)))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class SepConv(nn.Module):
    """DARTS separable convolution: ReLU, depthwise k x k, pointwise, BN."""

    def __init__(self, c: int, k: int):
        super().__init__()
        self.op = nn.Sequential(nn.ReLU(inplace=False), nn.Conv2d(c, c, k, 1, k // 2, groups=c, bias=False),
                                nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


def nas_op(kind: str, c: int) -> nn.Module:
    if kind == "sep3":
        return SepConv(c, 3)
    if kind == "sep5":
        return SepConv(c, 5)
    if kind == "max3":
        return nn.MaxPool2d(3, 1, 1)
    if kind == "avg3":
        return nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    if kind == "skip":
        return nn.Identity()
    raise ValueError(f"unknown NAS op {kind!r}")


# (op, input state) pairs per intermediate node; states 0 and 1 are the cell's inputs.
# Shaped like DARTS' normal cell: four nodes of two ops each, concatenated.
GENOTYPE = (
    (("sep3", 0), ("sep5", 1)),
    (("sep3", 0), ("max3", 1)),
    (("sep5", 2), ("avg3", 0)),
    (("sep3", 3), ("skip", 2)),
)


class NASCell(nn.Module):
    """One cell: preprocess both inputs to ``c`` channels, eight ops over earlier states, concat."""

    def __init__(self, c_prev_prev: int, c_prev: int, c: int):
        super().__init__()
        self.pre0 = conv_bn_relu(c_prev_prev, c, 1)
        self.pre1 = conv_bn_relu(c_prev, c, 1)
        self.ops = nn.ModuleList(nas_op(kind, c) for node in GENOTYPE for kind, _ in node)
        self.out_channels = c * len(GENOTYPE)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = [self.pre0(s0), self.pre1(s1)]
        ops = iter(self.ops)
        for node in GENOTYPE:
            states.append(sum(next(ops)(states[i]) for _, i in node))
        return torch.cat(states[2:], 1)


class NASCellNet(nn.Module):
    """Stem and ``cells`` cells, each fed by the two previous states (as in NASNet and DARTS)."""

    def __init__(self, c: int = 32, cells: int = 4, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.stem = conv_bn_relu(3, c, 3, stride=2)
        cells_, c_pp, c_p = [], c, c
        for _ in range(cells):
            cell = NASCell(c_pp, c_p, c)
            cells_.append(cell)
            c_pp, c_p = c_p, cell.out_channels
        self.cells = nn.ModuleList(cells_)
        self.head = nn.Linear(c_p, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(s1, 1), 1))


SYNTHETIC_IMAGE_SIZE = 64


def parse_branchy(name: str) -> tuple[int, int]:
    """Return (branches, width) of a ``branchy:<branches>x<width>`` name."""
    try:
        branches, width = name.split(":", 1)[1].lower().split("x")
        return int(branches), int(width)
    except (IndexError, ValueError):
        raise ValueError(f"model {name!r}: write branchy:<branches>x<width>, e.g. branchy:8x64") from None


def build(name: str) -> tuple[nn.Module, int]:
    """Return ``(model, image_size)`` for a sweep model name (see the module docstring)."""
    if name in TORCHVISION_MODELS or name in TIMM_MODELS:
        make, size = {**TORCHVISION_MODELS, **TIMM_MODELS}[name]
        return make(), size
    if name.startswith("branchy:"):
        branches, width = parse_branchy(name)
        return BranchyNet(branches, width), SYNTHETIC_IMAGE_SIZE
    if name == "nascell" or name.startswith("nascell:"):
        width = int(name.split(":", 1)[1]) if ":" in name else 32
        return NASCellNet(width), SYNTHETIC_IMAGE_SIZE
    if name.startswith(("torchvision:", "timm:")):  # any zoo model, at the input size it is made for
        from concur import zoo

        made = zoo.load(name)
        return made.model, made.image_size
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(TORCHVISION_MODELS)}, "
                     "branchy:<branches>x<width> (e.g. branchy:8x64), nascell[:<width>], torchvision:NAME, timm:NAME")


BUILDERS: dict[str, Callable[[], tuple[nn.Module, int]]] = {
    name: (lambda n=name: build(n)) for name in [*TORCHVISION_MODELS, "branchy:8x64", "branchy:4x128", "nascell"]
}
DEFAULT_MODELS = list(BUILDERS)


def cuda_setup(name: str, batch_size: int) -> tuple[nn.Module, tuple, nn.Module, Callable]:
    """A seeded channels-last model on the GPU, a batch, the loss and the optimizer factory: the common ground of
    the one-process tools (memory_diff.py, setup_cost.py), so both sides of a comparison start alike."""
    torch.manual_seed(0)
    model, size = build(name)
    model = model.cuda().to(memory_format=torch.channels_last).train()
    batch = (torch.randn(batch_size, 3, size, size, device="cuda").to(memory_format=torch.channels_last),
             torch.randint(0, NUM_CLASSES, (batch_size,), device="cuda"))
    optimizer = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    return model, batch, nn.CrossEntropyLoss(), optimizer

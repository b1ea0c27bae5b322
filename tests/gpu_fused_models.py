"""The models the fused path's GPU tests train: torchvision's three and two branchy timm nets.

Each entry is (builder, image size, batch). Batch 8 keeps a step short; the
cost of these tests is compiling, minutes per model on the H100 machine.
``hrnet_w18_small`` (four resolutions side by side, exchanged at every
stage) and ``dla34`` (tree-shaped aggregation) are branchy in ways the
torchvision models are not; ``resnest14d``'s 1x1 convolutions after an
avg-pool or a split sum take contiguous inputs in a channels-last model,
the case where the weight-gradient split copies the input for cuDNN.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

TIMM_MODELS = ("hrnet_w18_small", "dla34", "resnest14d")


def _torchvision(name: str, **kwargs) -> nn.Module:
    import torchvision

    return torchvision.models.get_model(name, weights=None, **kwargs)


def _timm(name: str) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False)


FUSED_MODELS: dict[str, tuple[Callable[[], nn.Module], int, int]] = {
    "googlenet": (lambda: _torchvision("googlenet", aux_logits=True, init_weights=False, dropout=0.0,
                                       dropout_aux=0.0), 224, 8),
    "inception_v3": (lambda: _torchvision("inception_v3", aux_logits=True, init_weights=False, dropout=0.0), 299, 8),
    "resnet50": (lambda: _torchvision("resnet50"), 224, 8),
    "hrnet_w18_small": (lambda: _timm("hrnet_w18_small"), 224, 8),
    "dla34": (lambda: _timm("dla34"), 224, 8),
    "resnest14d": (lambda: _timm("resnest14d"), 224, 8),
}

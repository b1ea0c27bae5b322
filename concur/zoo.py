"""Build models named on the command line: ``torchvision:googlenet`` or ``package.module:factory``."""

from __future__ import annotations

import importlib

import torch.nn as nn

# Smallest input each branchy torchvision model accepts (Inception-v3 needs 299 in train
# mode with its auxiliary head, 75 otherwise).
MIN_IMAGE_SIZE = {"inception_v3": 75, "googlenet": 32}


def build_model(spec: str) -> nn.Module:
    """Return a randomly initialised model from ``torchvision:NAME`` or ``module:callable``."""
    if ":" not in spec:
        raise ValueError(f"model spec {spec!r} must look like torchvision:googlenet or my.module:make_model")
    source, name = spec.split(":", 1)
    if source == "torchvision":
        import torchvision

        kwargs = {"weights": None}
        if name in ("googlenet", "inception_v3"):
            kwargs.update(init_weights=False, aux_logits=False)
        try:
            return torchvision.models.get_model(name, **kwargs)
        except ValueError as exc:
            raise ValueError(f"unknown torchvision model {name!r}: {exc}") from None
    factory = getattr(importlib.import_module(source), name)
    return factory()

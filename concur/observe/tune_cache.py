"""The tuner's on-disk cache: one JSON file per (model structure, inputs, GPU, torch) key.

Tuning costs up to ~20 s of GPU time; the same model on the same GPU with the
same input shapes picks the same configuration, so the next run reads the
choice instead of measuring again. The key hashes what changes step time (the
module tree with each module's settings, parameter and input shapes and
dtypes, GPU name, torch version) and nothing that does not (parameter values).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import torch

from concur.dag.annotate import tensors_in
from concur.dag.disk_cache import FORMAT, JsonCache, default_cache_dir

__all__ = ["FORMAT", "TunerCache", "cache_key", "clear_cache", "default_cache_dir"]


def cache_key(model: torch.nn.Module, example_batch: Any, device_name: str,
              torch_version: str = torch.__version__, *, extra: Sequence[Any] = ()) -> str:
    """Return a hex digest of the model's structure, the batch's shapes and dtypes, GPU and torch.

    ``extra`` holds anything else the choice depends on (optimizer type,
    candidate schedulers, ...). Parameter *values* are left out on purpose:
    training changes them and not the best stream count.
    """
    h = hashlib.sha256()

    def add(*parts: Any) -> None:
        h.update(repr(parts).encode())
        h.update(b"\0")

    add("model", type(model).__module__, type(model).__qualname__)
    for name, m in model.named_modules():
        add("module", name, type(m).__module__, type(m).__qualname__, m.extra_repr(), m.training)
    for name, p in model.named_parameters():
        add("param", name, tuple(p.shape), str(p.dtype), p.requires_grad)
    for name, b in model.named_buffers():
        add("buffer", name, tuple(b.shape), str(b.dtype))
    for t in tensors_in(example_batch):
        add("input", tuple(t.shape), str(t.dtype))
    add("device", device_name, "torch", torch_version, "extra", tuple(map(str, extra)))
    return h.hexdigest()[:32]


class TunerCache(JsonCache):
    """Tuning results on disk under ``directory/tuner/<key>.json``; unreadable entries count as misses."""

    kind = "tuner"


def clear_cache(cache_dir: str | os.PathLike | None = None) -> int:
    """Delete the tuner's cached choices and the measured stream decisions; return how many.

    Default directory: see :func:`default_cache_dir`.
    """
    return TunerCache(cache_dir).clear() + JsonCache(cache_dir, "decisions").clear()

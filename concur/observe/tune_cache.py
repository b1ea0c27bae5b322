"""The tuner's on-disk cache: one JSON file per (model structure, inputs, GPU, torch) key.

Tuning costs up to ~20 s of GPU time; the same model on the same GPU with the
same input shapes picks the same configuration, so the next run reads the
choice instead of measuring again. The key hashes what changes step time (the
module tree with each module's settings, parameter and input shapes and
dtypes, GPU name, torch version) and nothing that does not (parameter values).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from concur.dag.annotate import tensors_in

FORMAT = 1


def default_cache_dir() -> Path:
    """Return ``$CONCUR_CACHE_DIR``, else ``$XDG_CACHE_HOME/concur``, else ``~/.cache/concur``."""
    if os.environ.get("CONCUR_CACHE_DIR"):
        return Path(os.environ["CONCUR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "concur"


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


class TunerCache:
    """Tuning results on disk under ``directory/tuner/<key>.json``; unreadable entries count as misses."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.path = self.directory / "tuner"

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """Return the stored result for ``key``, or None."""
        file = self._file(key)
        if not file.exists():
            return None
        try:
            entry = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            warnings.warn(f"concur tuner cache: ignoring unreadable {file} ({exc}); tuning again.",
                          RuntimeWarning, stacklevel=2)
            return None
        if entry.get("format") != FORMAT:
            return None
        return entry["result"]

    def put(self, key: str, result: dict) -> Path:
        """Store ``result`` for ``key`` atomically (a crash never leaves half a file) and return its path."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "result": result}, f, indent=1)
        os.replace(tmp, self._file(key))
        return self._file(key)

    def entries(self) -> list[Path]:
        """Return the cache files."""
        return sorted(self.path.glob("*.json")) if self.path.exists() else []

    def clear(self) -> int:
        """Delete every cached result; return how many were deleted."""
        files = self.entries()
        for f in files:
            f.unlink(missing_ok=True)
        return len(files)


def clear_cache(cache_dir: str | os.PathLike | None = None) -> int:
    """Delete the tuner's cached choices (default directory: see :func:`default_cache_dir`)."""
    return TunerCache(cache_dir).clear()

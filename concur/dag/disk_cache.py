"""Measured choices on disk, one JSON file per key, so the next run reads them instead of measuring again.

Two kinds share one directory (:func:`default_cache_dir`): the tuner's
stream counts (``tuner/``, :mod:`concur.observe.tune_cache`) and the
keep-or-drop decisions of :mod:`concur.dag.decide` (``decisions/``). Each
key is a digest of everything the choice depends on, made by its user; an
entry that cannot be read counts as a miss.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

FORMAT = 1


def default_cache_dir() -> Path:
    """Return ``$CONCUR_CACHE_DIR``, else ``$XDG_CACHE_HOME/concur``, else ``~/.cache/concur``."""
    if os.environ.get("CONCUR_CACHE_DIR"):
        return Path(os.environ["CONCUR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "concur"


class JsonCache:
    """Results on disk under ``directory/kind/<key>.json``; unreadable entries count as misses."""

    kind = "decisions"

    def __init__(self, directory: str | os.PathLike | None = None, kind: str | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.path = self.directory / (kind or self.kind)

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
            warnings.warn(f"concur cache: ignoring unreadable {file} ({exc}); measuring again.",
                          RuntimeWarning, stacklevel=2)
            return None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None
        return entry.get("result")

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

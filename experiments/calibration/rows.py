"""The rows a calibration is fitted to: measured decisions, and older sweep runs' whole steps.

A measured decision (:mod:`concur.dag.decide`, one JSON file of a
``decisions/`` cache) holds one graph's prediction and the medians of its
one-stream and multi-stream replays; a row pairs the two. Anything else
under the directories read (tuner entries, other formats, unreadable files)
is passed over and counted, so a run's whole tree can be named.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from concur.dag import disk_cache


@dataclass(frozen=True)
class Row:
    """One measured graph: its prediction and its measurement."""

    model: str                 # the model and its configuration (a run's per-model directory)
    graph: str                 # what was decided ("the backward graph of 812 ops (230 launches)")
    predicted: float           # the contention model's speedup
    ideal: float | None        # the ideal speedup (None: not recorded)
    measured: float            # one_stream_ms / streams_ms
    one_stream_ms: float
    streams_ms: float
    serial_us: float | None = None
    streams_us: float | None = None
    num_streams: int | None = None
    source: str = ""           # the file it was read from
    gpu: str | None = None     # where the entry says (decision entries do not)
    torch: str | None = None
    date: str | None = None

    @property
    def network(self) -> str:
        """Return the model's name without a batch-size suffix: what cross-validation leaves out together."""
        return re.split(r"[-_]b\d", self.model, maxsplit=1)[0]


def model_of(path: Path) -> str:
    """Return the nearest directory name above ``path`` that is not ``decisions``."""
    for parent in path.resolve().parents:
        if parent.name and parent.name != "decisions":
            return parent.name
    return "?"


def _positive(value: object) -> float | None:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def row_of_entry(path: Path) -> Row | None:
    """Return the measured decision in ``path``, or None (not one: a tuner entry, another format, unreadable)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    result = entry.get("result") if isinstance(entry, dict) and entry.get("format") == disk_cache.FORMAT else None
    if not isinstance(result, dict) or result.get("scope", "graph") != "graph":  # a whole step's: not one graph's
        return None
    one, many, predicted = (_positive(result.get(k)) for k in ("one_stream_ms", "streams_ms", "predicted_speedup"))
    if one is None or many is None or predicted is None:
        return None
    streams = result.get("num_streams")
    date = result.get("date") or datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc
                                                                  ).date().isoformat()
    return Row(model_of(path), str(result.get("what", path.stem)), predicted, _positive(result.get("ideal_speedup")),
               one / many, one, many, _positive(result.get("serial_us")), _positive(result.get("streams_us")),
               int(streams) if isinstance(streams, (int, float)) else None, str(path),
               result.get("gpu"), result.get("torch"), date)


def read_decisions(dirs: Sequence[Path]) -> tuple[list[Row], int]:
    """Return the measured decisions under ``dirs`` (any depth), and how many other JSON files were passed over."""
    rows, skipped = [], 0
    for d in dirs:
        for path in sorted(Path(d).rglob("*.json")):
            row = row_of_entry(path)
            if row is None:
                skipped += 1
            else:
                rows.append(row)
    return rows, skipped


def read_sweep(files: Sequence[Path]) -> list[Row]:
    """Return a sweep's unfused whole steps: ``concur_graph:K`` against ``serial_graph``, one file at a time."""
    rows = []
    for file in files:
        done = [json.loads(line) for line in Path(file).read_text().splitlines() if line.strip()]
        done = [r for r in done if r.get("status") == "ok" and _positive(r.get("ms"))]
        serial = {(r.get("model"), r.get("batch"), r.get("precision")): r for r in done
                  if r.get("mode") == "serial_graph"}
        for r in done:
            mode = str(r.get("mode", ""))
            base = serial.get((r.get("model"), r.get("batch"), r.get("precision")))
            if not (mode.startswith("concur_graph:") and mode.split(":")[1].isdigit()) or base is None:
                continue
            predicted = _positive(r.get("predicted_speedup"))
            if predicted is None:
                continue
            rows.append(Row(str(r["model"]), f"step b{r.get('batch')} {r.get('precision')}, unfused {mode}",
                            predicted, _positive(r.get("ideal_speedup")), base["ms"] / r["ms"], base["ms"], r["ms"],
                            num_streams=int(mode.split(":")[1]), source=str(file), gpu=r.get("gpu"),
                            torch=r.get("torch"), date=r.get("date")))
    return rows

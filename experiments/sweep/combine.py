"""One run as the union of runs measured in parts (``--combine``), never overwriting a measured run."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.sweep.rows import read_rows


def combine_runs(sources: list[Path], out: Path) -> list[dict]:
    """Write ``out/results.jsonl`` as the union of the runs in ``sources``; return its rows.

    A sweep too long for one sitting is measured in parts, each its own run
    directory; the union is the whole sweep. Where two parts measured the same
    configuration the later source wins. Each row keeps its own date and gains
    ``source``, the directory it came from. ``out`` must not hold a measured run:
    only a previous union is replaced, so no measurement is overwritten.
    """
    jsonl = out / "results.jsonl"
    if any("source" not in r for r in read_rows(jsonl)):
        raise SystemExit(f"{jsonl} holds measured rows; --combine writes only to a new or combined directory")
    by_key: dict[str, dict] = {}
    for src in sources:
        rows = read_rows(src / "results.jsonl")
        if not rows:
            raise SystemExit(f"no rows in {src / 'results.jsonl'}")
        for r in rows:
            by_key.pop(r["key"], None)  # the later source's row, in the later source's order
            by_key[r["key"]] = dict(r, source=str(r.get("source", src)))
    out.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("".join(json.dumps(r, default=str) + "\n" for r in by_key.values()))
    return list(by_key.values())

"""The rows of a run: reading results.jsonl, the meta every row carries, and where a run's files go.

A row is a plain dict, one JSON line, so that a run interrupted at any point
keeps every finished row and a resumed run can append to it.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
META_FIELDS = ("date", "gpu", "driver", "torch", "cuda", "concur")


def read_rows(path: Path) -> list[dict]:
    """Return the rows of a results.jsonl; a line cut off by an interruption is ignored."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def run_meta() -> dict:
    """Return date, GPU, driver, torch and CUDA versions: the fields every result file carries."""
    import torch

    import concur
    from concur.observe.monitor import driver_version

    cuda = torch.cuda.is_available()
    return dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name() if cuda else "cpu",
                driver=driver_version(), torch=torch.__version__, cuda=torch.version.cuda,
                concur=concur.__version__)


def meta_of_rows(rows: list[dict], fallback: dict) -> dict:
    """The run's date, GPU, driver and versions as its rows recorded them (a resumed run may mix them)."""
    meta = {}
    for k in META_FIELDS:
        values = sorted({str(r[k]) for r in rows if r.get(k) is not None})
        meta[k] = " + ".join(values) if values else fallback.get(k)
    return meta


def default_out(meta: dict) -> Path:
    """Return ``experiments/results/<date>-<gpu>``: the run directory when ``--out`` is not given."""
    gpu = "".join(c if c.isalnum() else "-" for c in meta["gpu"].lower()).strip("-")
    return REPO / "experiments" / "results" / f"{meta['date']}-{gpu}"

"""The run directory that experiments write and ``concur report`` reads.

::

    RUN_DIR/
      run.json                 meta (GPU, torch, date) and one entry per case (model, batch)
      monitor/<case>.json      NVML samples of the case, with a mark per phase (eager, serial, ...)
      traces/<case>_<label>.json.gz   torch.profiler Chrome traces (open them in Perfetto)

``run.json`` is rewritten after every case, so a run cut short still reports
what it measured.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Variant", "TraceRef", "Case", "Run", "slug", "load_run", "RunWriter"]

RUN_FILE = "run.json"


@dataclass
class Variant:
    """One measured way of running a case's training step (eager, serial graph, k streams, ...)."""

    label: str
    streams: int | None = None        # None: the plain eager loop, no concur plan
    scheduler: str | None = None
    cuda_graph: bool = False
    median_ms: float | None = None
    iqr_ms: float | None = None
    repeats: int = 0
    peak_mb: float | None = None
    error: str | None = None
    role: str = "sweep"               # "eager", "serial", "sweep" or "tuned"


@dataclass
class TraceRef:
    """A profiler trace of one variant; ``mode`` says whether the kernels came from graph replays."""

    label: str
    path: str                         # relative to the run directory
    mode: str = "graph replay"        # or "eager (graph replays hidden from the profiler)"


@dataclass
class Case:
    """One model at one batch size: its variants, the tuner's result, NVML record and traces."""

    name: str
    model: str = ""
    batch: int = 0
    variants: list[Variant] = field(default_factory=list)
    tuner: dict | None = None         # TuneResult.to_dict()
    monitor: str | None = None        # relative path of a MonitorRecord JSON
    traces: list[TraceRef] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def variant(self, role: str) -> Variant | None:
        """Return the first variant with ``role``, or None."""
        return next((v for v in self.variants if v.role == role), None)


@dataclass
class Run:
    """Everything an experiment measured; ``meta`` holds GPU, torch, driver, date."""

    meta: dict = field(default_factory=dict)
    cases: list[Case] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Run:
        """Rebuild a run written by :meth:`to_dict`."""
        cases = []
        for c in data.get("cases", []):
            c = dict(c)
            c["variants"] = [Variant(**v) for v in c.get("variants", [])]
            c["traces"] = [TraceRef(**t) for t in c.get("traces", [])]
            cases.append(Case(**c))
        return cls(dict(data.get("meta", {})), cases)


def slug(text: str) -> str:
    """Return ``text`` as a file-name-safe slug ('GoogLeNet b8' -> 'googlenet_b8')."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read ``RUN_DIR/run.json``."""
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory written by an experiment?")
    return Run.from_dict(json.loads(path.read_text()))


class RunWriter:
    """Builds a run directory case by case; :meth:`save` after each so partial runs survive."""

    def __init__(self, run_dir: str | os.PathLike, meta: dict[str, Any] | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = Run(dict(meta or {}), [])

    def case(self, name: str, **fields: Any) -> Case:
        """Add and return a new case."""
        case = Case(name, **fields)
        self.run.cases.append(case)
        return case

    def monitor_path(self, case: Case) -> Path:
        """Return where the case's NVML record goes, and note it in the case."""
        case.monitor = f"monitor/{slug(case.name)}.json"
        return self.dir / case.monitor

    def trace_path(self, case: Case, label: str, mode: str = "graph replay") -> Path:
        """Return where a trace of ``label`` goes (gzip), and note it in the case."""
        rel = f"traces/{slug(case.name)}_{slug(label)}.json.gz"
        case.traces = [t for t in case.traces if t.label != label] + [TraceRef(label, rel, mode)]
        (self.dir / "traces").mkdir(exist_ok=True)
        return self.dir / rel

    def save(self) -> Path:
        """Write run.json and return its path."""
        path = self.dir / RUN_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.run.to_dict(), indent=1))
        os.replace(tmp, path)
        return path

"""Read a torch.profiler Chrome trace into per-stream GPU intervals and per-step kernel overlap.

Overlap is what streams buy: in each training step, the summed duration of
its kernels over the step's wall time on the GPU. A serial plan stays at or
below 1.0 (gaps are launch or dependency waits); above 1.0 kernels ran at the
same time. ``busy`` (the union of kernel intervals) separates the two: wall
minus busy is idle GPU time, kernel time over busy time is the mean number of
kernels running whenever any is.

Steps come from the ``ProfilerStep#N`` ranges that ``torch.profiler.schedule``
records on the CPU. A kernel belongs to the step whose range holds the CPU
call that launched it (linked by the ``correlation`` id), which also works
for kernels replayed from a CUDA graph: they carry the correlation of their
``cudaGraphLaunch``. Some torch/CUPTI versions do not report kernels inside
graph replays at all; :attr:`TraceSummary.kernels_hidden` says so, and the
caller then profiles the same plan without the graph.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "KernelInterval",
    "StepOverlap",
    "TraceSummary",
    "load_events",
    "parse_events",
    "parse_trace",
    "profile_steps",
]

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver", "runtime")


@dataclass(frozen=True)
class KernelInterval:
    """One GPU activity (kernel, memcpy or memset) on one stream; times in microseconds."""

    name: str
    stream: int
    start_us: float
    end_us: float
    step: int | None = None
    category: str = "kernel"

    @property
    def dur_us(self) -> float:
        """Return the duration in microseconds."""
        return self.end_us - self.start_us


@dataclass(frozen=True)
class StepOverlap:
    """Kernel time, busy time and wall time of one training step on the GPU (microseconds)."""

    step: int
    kernels: int
    streams: int
    kernel_us: float
    busy_us: float
    wall_us: float

    @property
    def overlap(self) -> float:
        """Summed kernel time over wall time: above 1.0 kernels ran concurrently."""
        return self.kernel_us / self.wall_us if self.wall_us > 0 else 0.0

    @property
    def concurrency(self) -> float:
        """Mean number of kernels running while any is (kernel time over busy time)."""
        return self.kernel_us / self.busy_us if self.busy_us > 0 else 0.0


@dataclass(frozen=True)
class TraceSummary:
    """The GPU side of a trace: intervals, per-step overlap, streams, graph launches."""

    kernels: tuple[KernelInterval, ...]
    steps: tuple[StepOverlap, ...]
    streams: tuple[int, ...]
    graph_launches: int

    @property
    def kernels_hidden(self) -> bool:
        """True when graphs were replayed but the profiler saw none of their kernels."""
        return self.graph_launches > 0 and not self.kernels

    def mean(self, attr: str) -> float | None:
        """Return the mean of a :class:`StepOverlap` attribute over the steps, None without steps."""
        values = [getattr(s, attr) for s in self.steps]
        return sum(values) / len(values) if values else None

    def to_dict(self) -> dict:
        """Return per-step numbers and their means (not the kernel list) as a JSON-ready dict."""
        steps = [dict(step=s.step, kernels=s.kernels, streams=s.streams, kernel_us=s.kernel_us, busy_us=s.busy_us,
                      wall_us=s.wall_us, overlap=s.overlap, concurrency=s.concurrency) for s in self.steps]
        means = {k: self.mean(k) for k in ("kernels", "kernel_us", "busy_us", "wall_us", "overlap", "concurrency")}
        return dict(streams=list(self.streams), graph_launches=self.graph_launches, kernels=len(self.kernels),
                    kernels_hidden=self.kernels_hidden, steps=steps, mean=means)


def load_events(path: str | os.PathLike) -> list[dict]:
    """Return the trace events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _stream_of(event: dict) -> int:
    args = event.get("args") or {}
    stream = args.get("stream", event.get("tid", 0))
    try:
        return int(stream)
    except (TypeError, ValueError):  # some exports name the thread "stream 7"
        return int(str(stream).split()[-1]) if str(stream).split()[-1].isdigit() else 0


def parse_events(events: Iterable[dict]) -> TraceSummary:
    """Return the GPU intervals of ``events``, each assigned to its profiler step, and per-step overlap."""
    steps: list[tuple[float, float, int]] = []
    launches: dict[Any, float] = {}
    graph_launches = 0
    gpu: list[dict] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if name.startswith("ProfilerStep#") and cat != "gpu_user_annotation":
            steps.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), int(name.split("#")[1])))
        elif cat in LAUNCH_CATEGORIES:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = float(e["ts"])
            graph_launches += "GraphLaunch" in name
        elif cat in GPU_CATEGORIES:
            gpu.append(e)
    steps.sort()
    starts = [s[0] for s in steps]

    def step_at(cpu_ts: float) -> int | None:
        i = bisect.bisect_right(starts, cpu_ts) - 1
        return steps[i][2] if i >= 0 and cpu_ts <= steps[i][1] else None

    kernels = []
    for e in gpu:
        start = float(e["ts"])
        corr = (e.get("args") or {}).get("correlation")
        if not steps:
            step = 0
        elif corr in launches:
            step = step_at(launches[corr])
        else:  # no launch record: the last step that began on the CPU before the kernel started
            i = bisect.bisect_right(starts, start) - 1
            step = steps[i][2] if i >= 0 else None
        kernels.append(KernelInterval(e.get("name", "?"), _stream_of(e), start, start + float(e.get("dur", 0)),
                                      step, e.get("cat", "kernel")))
    kernels.sort(key=lambda k: (k.start_us, k.stream))
    per_step: dict[int, list[KernelInterval]] = {}
    for k in kernels:
        if k.step is not None:
            per_step.setdefault(k.step, []).append(k)
    overlaps = tuple(
        StepOverlap(step=n, kernels=len(ks), streams=len({k.stream for k in ks}),
                    kernel_us=sum(k.dur_us for k in ks), busy_us=_union_us([(k.start_us, k.end_us) for k in ks]),
                    wall_us=max(k.end_us for k in ks) - min(k.start_us for k in ks))
        for n, ks in sorted(per_step.items()))
    return TraceSummary(tuple(kernels), overlaps, tuple(sorted({k.stream for k in kernels})), graph_launches)


def parse_trace(path: str | os.PathLike) -> TraceSummary:
    """Return the :class:`TraceSummary` of a Chrome trace file."""
    return parse_events(load_events(path))


def profile_steps(step: Callable[[], Any], path: str | os.PathLike, *, active: int = 3, warmup: int = 1) -> Path:
    """Profile ``active`` calls of ``step`` (after ``warmup``) with torch.profiler; write a Chrome trace.

    CPU activity is recorded too: its ``ProfilerStep`` ranges and launch
    calls are what assign kernels to steps. A path ending in ``.gz`` is
    gzip-compressed (Perfetto opens it as is).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    raw = path.with_name(path.name.removesuffix(".gz")) if path.suffix == ".gz" else path
    # The trace is written when the active window ends; after that the profiler clears its events.
    with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(raw))) as prof:
        for _ in range(warmup + active):
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.step()
    if raw != path:
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        raw.unlink()
    return path

"""What a child of ``experiments/memory.py`` records beyond its peaks and times, for where a configuration misses.

- :func:`breakdown`: reserved and allocated MB by memory pool and stream (a
  graph's private pool apart from the default one, each stream apart);
- :func:`trace_out_of_memory`: each allocation that ran out of memory, raised
  or recovered from: the setup call, its size, the stream, the project's frames;
- :class:`CallLog`: a concur step's calls that changed its captures;
- :func:`profile_kernels`, :func:`profile_host`: a few steps under
  ``torch.profiler`` (the CUDA kernels with the most time) and cProfile (the
  host's functions, and the dispatch modes left on torch's stack).

Imports nothing from concur: the recipe's children use it too.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

MB = 2**20
PROFILED_STEPS = 5  # steps profiled for --kernels, after the timed ones
OWN_FILES = re.compile(r"[/\\](concur|experiments|torchvision|timm)[/\\]")  # frames an out-of-memory trace keeps


def breakdown() -> dict[str, list[float]]:
    """Reserved and allocated MB by memory pool and stream, from the caching allocator's segments: a graph's
    private pool apart from the default one, each stream's blocks apart (a block serves only its stream)."""
    by: dict[str, list[float]] = {}
    streams: dict[int, str] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        stream = streams.setdefault(segment["stream"], f"stream{len(streams)}")
        key = f"{'default' if pool == (0, 0) else f'pool{pool[0]}.{pool[1]}'} {stream}"
        entry = by.setdefault(key, [0.0, 0.0])
        entry[0] += segment["total_size"] / MB
        entry[1] += segment["allocated_size"] / MB
    return {k: [round(r, 1), round(a, 1)] for k, (r, a) in sorted(by.items())}



def top_kernels(averages: Iterable[Any], steps: int, n: int) -> list[dict]:
    """The ``n`` kernels of ``torch.profiler``'s ``key_averages()`` that took the most device time, per step of
    ``steps``: name (cut to 160 characters), microseconds and calls."""
    timed = [(e.key, getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0), e.count)
             for e in averages]
    timed = [t for t in timed if t[1] > 0]
    timed.sort(key=lambda t: -t[1])
    return [dict(kernel=name[:160], us_per_step=round(us / steps, 2), calls_per_step=round(count / steps, 2))
            for name, us, count in timed[:n]]


def profile_kernels(fn: Callable[[], Any], steps: int, n: int) -> list[dict]:
    """Run ``fn`` ``steps`` times under the profiler (CUDA activity only); return :func:`top_kernels`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return top_kernels(prof.key_averages(), steps, n)


def profile_host(fn: Callable[[], Any], steps: int, n: int) -> dict:
    """Run ``fn`` ``steps`` times under cProfile: the host's milliseconds per step and the ``n`` functions with the
    most cumulative time per step; and the dispatch modes left on torch's stack (none, in a step between calls)."""
    import cProfile
    import pstats

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    torch.cuda.synchronize()
    profiler, start = cProfile.Profile(), time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    wall = (time.perf_counter() - start) / steps
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own, cumulative, callers)
    top = sorted(stats.items(), key=lambda kv: -kv[1][3])[:n]
    return dict(ms_per_step=round(wall * 1e3, 2),
                dispatch_modes=[type(m).__name__ for m in _get_current_dispatch_mode_stack()],
                functions=[dict(function=f"{os.path.basename(f)}:{line} {name}", calls_per_step=c / steps,
                                ms_per_step=round(cum / steps * 1e3, 2)) for (f, line, name), (c, _, _, cum, _) in top])


OOM_FRAMES = 8  # the innermost frames of the project's own files, per allocation that ran out


def trace_out_of_memory(row: dict, calls: list[int]) -> None:
    """Record in ``row["oom_trace"]`` every allocation that runs out of memory from now on, raised or recovered
    from: the setup call it came in (0: the first), its MiB, the stream current then, and where (the innermost
    frames of concur's, the experiments' and the networks' files; aten's own calls, a cuDNN workspace say, have no
    frame of theirs)."""
    trace = row.setdefault("oom_trace", [])

    def observe(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        frames = [f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack()[:-1] if OWN_FILES.search(f.filename)]
        stream = current_stream()  # in a backward, the stream of the node that allocates
        trace.append(dict(call=calls[0], mib=alloc / MB, allocated_mib=device_allocated / MB, stream=stream,
                          stack=frames[-OOM_FRAMES:]))

    torch._C._cuda_attach_out_of_memory_observer(observe)


class CallLog:
    """A concur step whose calls are logged where its captures change: the call (0: the first), its host
    milliseconds, the captures and failures so far, its trial, the rungs given up, and the last fallback. A step
    that captures again in its steady state (a trial's next program, a rung tried once more) shows here."""

    def __init__(self, step: Any, log: list):
        self._step, self._log, self._calls = step, log, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def __call__(self, *batch: Any) -> Any:
        before = (self._step.status.captures, self._step.status.failures)
        start = time.perf_counter()
        loss = self._step(*batch)
        took = (time.perf_counter() - start) * 1e3
        status = self._step.status
        if (status.captures, status.failures) != before:
            trial = getattr(self._step, "_trial", None)
            self._log.append(dict(call=self._calls, host_ms=round(took, 1), captures=status.captures,
                                  failures=status.failures, streams=status.streams,
                                  trial=type(trial).__name__ if trial is not None else None,
                                  failed_streams=sorted(map(str, getattr(self._step, "failed_streams", ()))),
                                  fallback=(status.fallbacks or [""])[-1][:160]))
        self._calls += 1
        return loss


def current_stream() -> dict | None:
    """The current CUDA stream's id and priority (the weight-gradient stream's is 0, the lowest); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.current_stream()
    return dict(id=stream.stream_id, priority=stream.priority)


def out_of_memory_count() -> int:
    """The allocations this process's allocator could not serve so far: those raised, and those an operation
    recovered from (cuDNN then runs, and keeps, a convolution algorithm with a smaller workspace)."""
    return int(torch.cuda.memory_stats().get("num_ooms", 0))

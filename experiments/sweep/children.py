"""The parent's side: run configurations in child processes, in memory waves, taking turns on the GPU.

Each child is ``python -m experiments.sweep --one|--group <json>`` and prints
one JSON row per configuration. A crash, an OOM kill or a hang becomes an
error row for the configuration it hit, and the sweep goes on. With
``--compile-jobs N`` children run N at once: they compile side by side and
time one at a time (:class:`GpuTurn`), in waves whose memory fits the GPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from experiments.sweep.configs import config_key, group_configs
from experiments.sweep.rows import REPO, read_rows, run_meta

WAVE_CAPACITY_PER_80GB = 1536
"""Sum of child sizes (batch x modes x 2 for fp32) a wave may hold on an 80 GB GPU: three Inception-v3
batch-128 fp32 pairs (size 512, about 21 GB each) fit on the H100. Scaled to other GPUs by their memory."""


class GpuTurn:
    """A file lock that lets sweep children compile side by side but time one at a time.

    Compiling and capturing take it shared: they run kernels (autotuning, warm-up
    steps) only now and then. Timing takes it exclusive, so no other child's
    kernels run beside the timed steps. flock converts shared to exclusive by
    dropping the shared lock first, so two children that finish compiling
    together do not deadlock. Without a path it does nothing.
    """

    def __init__(self, path: str | None):
        self._file = open(path, "a") if path else None

    def _lock(self, how: int) -> None:
        if self._file is not None:
            fcntl.flock(self._file, how)

    def shared(self) -> None:
        self._lock(fcntl.LOCK_SH)

    def exclusive(self) -> None:
        self._lock(fcntl.LOCK_EX)

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the lock
            self._file = None


def _run_child(flag: str, payload: Any, timeout_s: float, extra_env: dict[str, str] | None = None
               ) -> tuple[str, tuple[str, str] | None]:
    """Run ``python -m experiments.sweep <flag> <json>``; return its stdout and (error, stderr tail) or None."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **(extra_env or {}))
    try:
        proc = subprocess.run([sys.executable, "-m", "experiments.sweep", flag, json.dumps(payload)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        return (out.decode(errors="replace") if isinstance(out, bytes) else out,
                (f"timeout after {timeout_s:.0f} s", ""))
    if proc.returncode != 0:
        return proc.stdout, (f"subprocess exited with {proc.returncode} (crash or OOM kill?)",
                             (proc.stderr or "")[-1500:])
    return proc.stdout, None


def _rows_printed(stdout: str) -> dict[str, dict]:
    return {row["key"]: row for row in (json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{"))}


def _error_row(cfg: dict, meta: dict, message: str, stderr_tail: str) -> dict:
    row = dict(cfg, key=config_key(cfg), started=time.time(), **meta, status="error", error=message,
               stderr_tail=stderr_tail)
    row.pop("fail", None)
    return row


@contextlib.contextmanager
def compile_caches(cfgs: list[dict]) -> Iterator[dict[str, str] | None]:
    """Empty inductor and Triton caches for a child that compiles cold; None (the shared ones) otherwise.

    A kernel another configuration already compiled would otherwise make a
    compile time look shorter than a user's first run.
    """
    if not any(c.get("compile_cache") == "cold" for c in cfgs):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="concur-sweep-cache-") as cache:
        yield {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}


def run_in_subprocess(cfg: dict, timeout_s: float, meta: dict) -> dict:
    """Run one configuration in a fresh interpreter; a crash or timeout becomes an error row."""
    with compile_caches([cfg]) as extra_env:
        stdout, error = _run_child("--one", cfg, timeout_s, extra_env)
    row = _rows_printed(stdout).get(config_key(cfg))
    if error is None and row is not None:
        return row
    return _error_row(cfg, meta, *(error or ("the child printed no row", "")))


def run_group_in_subprocess(cfgs: list[dict], timeout_s: float, meta: dict) -> list[dict]:
    """Run configurations in one fresh interpreter; what a crash or hang left undone runs one per child."""
    if len(cfgs) == 1:
        return [run_in_subprocess(cfgs[0], timeout_s, meta)]
    with compile_caches(cfgs) as extra_env:
        stdout, error = _run_child("--group", cfgs, timeout_s * len(cfgs), extra_env)
    rows = _rows_printed(stdout)
    result = []
    for i, cfg in enumerate(cfgs):
        if config_key(cfg) in rows:
            result.append(rows[config_key(cfg)])
            continue
        # the child died on this configuration: record it, run the rest one per child
        result.append(_error_row(cfg, meta, *(error or ("the child printed no row for it", ""))))
        result.extend(run_in_subprocess(c, timeout_s, meta) for c in cfgs[i + 1:])
        break
    return result


def memory_waves(groups: list[list[dict]], jobs: int,
                 capacity: int = WAVE_CAPACITY_PER_80GB) -> list[list[list[dict]]]:
    """Split groups into waves of at most ``jobs`` whose memory, roughly estimated, stays within ``capacity``.

    Children of one wave hold their models, graphs and memory pools at once;
    in sweep order a wave would be one model's largest batches together, which
    does not fit in an 80 GB GPU for Inception-v3 at batch 128. The estimate is
    batch x modes in the child x 2 for fp32: enough to keep the large ones apart.
    The capacity is absolute, not relative to the largest child, so a resumed
    sweep of small batches still runs ``jobs`` at once; a child larger than it
    runs alone.
    """
    def size(g: list[dict]) -> int:
        return g[0]["batch"] * len(g) * (1 if g[0]["precision"] == "bf16" else 2)

    left = sorted(groups, key=size, reverse=True)
    waves = []
    while left:
        wave, used = [], 0
        for g in list(left):
            if len(wave) < jobs and (not wave or used + size(g) <= capacity):
                wave.append(g)
                used += size(g)
                left.remove(g)
        waves.append(wave)
    return waves


def wave_capacity() -> int:
    """``WAVE_CAPACITY_PER_80GB`` scaled to this machine's GPU memory (unscaled without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return WAVE_CAPACITY_PER_80GB
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return int(WAVE_CAPACITY_PER_80GB * gib / 79.2)  # the H100 80GB reports 79.2 GiB


def _fmt_s(s: float) -> str:
    return f"{s / 60:.0f}m{s % 60:02.0f}s" if s >= 60 else f"{s:.0f}s"


class Progress:
    """One stderr line per finished configuration: count, percent, elapsed and estimated time left."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.time()

    def update(self, key: str, status: str) -> None:
        self.done += 1
        elapsed = time.time() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        width = 24
        bar = "#" * round(width * self.done / self.total)
        print(f"[{bar:<{width}}] {self.done}/{self.total} {100 * self.done / self.total:3.0f}%  "
              f"elapsed {_fmt_s(elapsed)}  left ~{_fmt_s(left)}  {key}: {status[:60]}", file=sys.stderr, flush=True)


def run_sweep(configs: list[dict], out: Path, resume: bool, timeout_s: float) -> tuple[list[dict], int]:
    """Run the configurations not yet in ``out/results.jsonl``; return (all rows, launched count)."""
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "results.jsonl"
    if jsonl.exists() and not resume:
        raise SystemExit(f"{jsonl} exists: pass --resume to continue that run, or another --out")
    if jsonl.exists() and jsonl.read_text()[-1:] not in ("", "\n"):
        with open(jsonl, "a") as f:  # a line cut by the interruption must not swallow the next row
            f.write("\n")
    done = {r["key"] for r in read_rows(jsonl)}
    todo = [c for c in configs if config_key(c) not in done]
    print(f"{len(configs)} configurations, {len(configs) - len(todo)} already in {jsonl}, running {len(todo)}",
          file=sys.stderr, flush=True)
    meta = run_meta()
    progress = Progress(len(todo))
    written = threading.Lock()

    def run(group: list[dict]) -> None:
        for row in run_group_in_subprocess(group, timeout_s, meta):
            with written, open(jsonl, "a") as f:  # appended at once: an interrupted sweep keeps every finished row
                f.write(json.dumps(row, default=str) + "\n")
                progress.update(row["key"], row["status"] if row["status"] != "error" else "ERROR " + row["error"])

    groups = group_configs(todo)
    side_by_side = [g for g in groups if g[0].get("gpu_lock")]
    for group in groups:  # first whatever times alone, then the children that share the machine
        if not group[0].get("gpu_lock"):
            run(group)
    jobs = side_by_side[0][0]["compile_jobs"] if side_by_side else 1
    # in waves: a child starting to compile while others wait to time would hold them up (GpuTurn)
    for wave in memory_waves(side_by_side, jobs, wave_capacity()):
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            for finished in concurrent.futures.as_completed([pool.submit(run, g) for g in wave]):
                finished.result()
    return read_rows(jsonl), len(todo)

"""What NVML says of a CUDA device, for timing (:mod:`concur.dag.measure`) and the monitor (:mod:`concur.observe.monitor`).

NVML numbers the GPUs of the machine, CUDA those ``CUDA_VISIBLE_DEVICES``
shows; NVML is optional (``nvidia-ml-py``), and every question here has an
answer that means "unknown" when it is missing.
"""

from __future__ import annotations

import os
from typing import Any


def other_processes_on(cuda_index: int, nvml: Any = None) -> int | None:
    """Return how many processes besides this one and its children run compute work on CUDA device ``cuda_index``.

    Per NVML; this process's own children do not count (inductor's compile
    workers may hold a CUDA context of their own). None where NVML cannot
    say: not installed, no driver, devices named by UUID in
    ``CUDA_VISIBLE_DEVICES`` (which NVML device is not known here), or this
    process not among those NVML lists (its pids are another namespace's, as
    in a container, or it sees no process at all): then whose the listed
    processes are is not known. ``nvml`` is for tests.
    """
    index = _listed_index(cuda_index)
    if index is None:
        return None
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library or no driver: unknown
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        pids = {int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception:  # noqa: BLE001 - MIG, permissions, an old driver: unknown
        return None
    finally:
        nvml.nvmlShutdown()
    me = os.getpid()
    if me not in pids:
        return None
    return sum(1 for pid in pids if not _descends_from(pid, me))


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or below it; one that cannot be read (it ended) counts as below it."""
    seen = set()
    while pid not in seen and pid > 1:
        if pid == ancestor:
            return True
        seen.add(pid)
        parent = _parent_of(pid)
        if parent is None:
            return True  # gone, or not readable here: not counted as another process's work
        pid = parent
    return False


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` from ``/proc`` (Linux), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm)": state, then the parent's pid
    except (OSError, ValueError, IndexError):
        return None


def nvml_index(cuda_index: int = 0) -> int:
    """Return the NVML index of CUDA device ``cuda_index`` (NVML ignores CUDA_VISIBLE_DEVICES), else ``cuda_index``."""
    index = _listed_index(cuda_index)
    return cuda_index if index is None else index


def _listed_index(cuda_index: int) -> int | None:
    """The NVML index of CUDA device ``cuda_index``: itself where ``CUDA_VISIBLE_DEVICES`` is unset, the number it
    lists there, or None where that entry is not a number (a UUID, a MIG slice): which NVML device is not known."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cuda_index
    try:
        return int(visible.split(",")[cuda_index])
    except (ValueError, IndexError):
        return None

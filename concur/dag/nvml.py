"""What NVML says of a CUDA device, for timing (:mod:`concur.dag.measure`) and the monitor (:mod:`concur.observe.monitor`).

NVML numbers the GPUs of the machine, CUDA those ``CUDA_VISIBLE_DEVICES``
shows; NVML is optional (``nvidia-ml-py``), and every question here has an
answer that means "unknown" when it is missing.
"""

from __future__ import annotations

import os
from typing import Any


def other_processes_on(cuda_index: int, nvml: Any = None) -> int | None:
    """Return how many processes besides this one run compute work on CUDA device ``cuda_index``, per NVML.

    None where NVML cannot say: not installed, no driver, devices named by
    UUID in ``CUDA_VISIBLE_DEVICES`` (which NVML device is not known here),
    or no process listed at all (this one has work there when it asks, so
    NVML cannot see processes here). Processes are counted, not matched by
    pid: in a container NVML gives the host's pids. ``nvml`` is for tests.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and not all(part.strip().isdigit() for part in visible.split(",")):
        return None
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library or no driver: unknown
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index(cuda_index))
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001 - MIG, permissions, an old driver: unknown
        return None
    finally:
        nvml.nvmlShutdown()
    return len(processes) - 1 if processes else None


def nvml_index(cuda_index: int = 0) -> int:
    """Return the NVML index of CUDA device ``cuda_index`` (NVML ignores CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    try:
        return int(visible[cuda_index])
    except (ValueError, IndexError):
        return cuda_index

"""Sample GPU utilization, memory, SM clock and power in a background thread (NVML).

Why utilization is read differently from the rest: NVML's utilization is the
fraction of a sample period in which *any* kernel ran, and the driver computes
it only every ~200 ms on an H100 (polling ``nvmlDeviceGetUtilizationRates``
faster repeats the same value). ``nvmlDeviceGetSamples`` hands out the
driver's own buffer of timestamped samples, so the monitor drains that buffer
from the last timestamp it saw. Memory used, SM clock and power are
instantaneous readings and are polled every ``interval_s`` (20 Hz by default).

What utilization says: low utilization of an eager loop means the GPU waits
for the CPU to launch kernels (capture a CUDA graph); under a CUDA graph it
reads ~100% even when streams still help, because it does not measure how
full the SMs are. The tuner uses it to pick the lever, never the stream count.

Without nvidia-ml-py, a driver or a GPU the monitor warns once, records
nothing and lets the program run on.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["Sample", "UtilizationSample", "Mark", "MonitorRecord", "driver_version", "Monitor"]

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass(frozen=True)
class Sample:
    """Instantaneous readings, ``t_s`` seconds after the monitor started; None where unsupported."""

    t_s: float
    memory_used_mb: float | None
    sm_clock_mhz: float | None
    power_w: float | None


@dataclass(frozen=True)
class UtilizationSample:
    """Percent of the driver's sample period in which a kernel ran, at ``t_s`` (driver timestamp)."""

    t_s: float
    gpu_percent: float


@dataclass(frozen=True)
class Mark:
    """A named point in time: the start of a phase (e.g. 'serial graph') of the monitored run."""

    t_s: float
    label: str


@dataclass
class MonitorRecord:
    """Everything one monitoring session saw; JSON-serialisable for reports."""

    available: bool
    reason: str = ""
    device: str = ""
    interval_s: float = 0.05
    utilization_source: str = ""  # "samples" (driver buffer) or "rates" (polled fallback)
    start_unix_s: float = 0.0
    duration_s: float = 0.0
    sampler_cpu_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    utilization: list[UtilizationSample] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    @property
    def overhead_fraction(self) -> float:
        """CPU time of the sampler thread per second of monitoring (one core = 1.0)."""
        return self.sampler_cpu_s / self.duration_s if self.duration_s > 0 else 0.0

    def phases(self) -> list[tuple[str, float, float]]:
        """Return (label, start_s, end_s) per mark; a phase lasts until the next mark or the end."""
        ends = [m.t_s for m in self.marks[1:]] + [self.duration_s]
        return [(m.label, m.t_s, end) for m, end in zip(self.marks, ends)]

    def mean_utilization(self, start_s: float = 0.0, end_s: float = float("inf")) -> float | None:
        """Return the mean GPU utilization (percent) of samples in [start_s, end_s), None if none."""
        values = [u.gpu_percent for u in self.utilization if start_s <= u.t_s < end_s]
        return sum(values) / len(values) if values else None

    def to_dict(self) -> dict:
        """Return a JSON-ready dict (see :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MonitorRecord:
        """Rebuild a record written by :meth:`to_dict`."""
        data = dict(data)
        data["samples"] = [Sample(**s) for s in data.get("samples", [])]
        data["utilization"] = [UtilizationSample(**u) for u in data.get("utilization", [])]
        data["marks"] = [Mark(**m) for m in data.get("marks", [])]
        return cls(**data)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the record as JSON and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> MonitorRecord:
        """Read a record written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def _open_nvml(nvml: Any, index: int) -> tuple[Any, Any, str]:
    """Return (nvml module, device handle, device name); raise RuntimeError saying why not."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            raise RuntimeError("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise RuntimeError(f"NVML cannot start (no NVIDIA driver?): {exc}") from None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
    except Exception as exc:
        nvml.nvmlShutdown()
        raise RuntimeError(f"NVML sees no GPU {index}: {exc}") from None
    return nvml, handle, name.decode() if isinstance(name, bytes) else str(name)


def driver_version() -> str:
    """Return the NVIDIA driver version from NVML, or "unknown" without NVML or a GPU (for result files)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: all mean unknown
        return "unknown"


def _tensorboard_writer(target: Any) -> Any:
    """Return a writer with ``add_scalar`` for ``target`` (a log dir or a writer), or None with a warning."""
    if target is None or hasattr(target, "add_scalar"):
        return target
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        _warn_once("concur.monitor: tensorboard is not installed (pip install tensorboard); "
                   "the samples are recorded but not logged to TensorBoard.")
        return None
    return SummaryWriter(log_dir=str(target))


_SAMPLE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class Monitor:
    """Background NVML sampler; use as ``with Monitor() as mon: ...`` then read ``mon.record``.

    ``nvml`` and ``clock`` exist for tests (a fake NVML module and a fake
    wall clock); ``clock`` must count seconds on the same base as NVML's
    sample timestamps (Unix time). ``tensorboard`` is a log directory or a
    ``SummaryWriter``-like object; the samples are logged to it as they come.
    """

    def __init__(self, device: int = 0, interval_s: float = 0.05, *, tensorboard: Any = None,
                 nvml: Any = None, clock: Callable[[], float] = time.time):
        self.device, self.interval_s, self.clock = device, interval_s, clock
        self._nvml_arg, self._tensorboard_arg = nvml, tensorboard
        self.record = MonitorRecord(available=False, interval_s=interval_s)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """True while (or after) the monitor sampled a GPU."""
        return self.record.available

    def __enter__(self) -> Monitor:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> Monitor:
        """Open NVML and start sampling; without NVML warn once and record nothing."""
        self.record = MonitorRecord(available=False, interval_s=self.interval_s)
        try:
            self._nvml, self._handle, name = _open_nvml(self._nvml_arg, self.device)
        except RuntimeError as exc:
            self.record.reason = str(exc)
            _warn_once(f"concur.monitor: no GPU metrics ({exc}); training is unaffected.")
            return self
        self._writer = _tensorboard_writer(self._tensorboard_arg)
        self._owns_writer = self._writer is not None and self._writer is not self._tensorboard_arg
        self._t0 = self.clock()
        self._last_util_us = int(self._t0 * 1e6)
        self.record = MonitorRecord(available=True, device=name, interval_s=self.interval_s,
                                    utilization_source="samples", start_unix_s=self._t0)
        self._unsupported: set[str] = set()
        self._stop.clear()
        self.poll()
        self._thread = threading.Thread(target=self._run, name="concur-monitor", daemon=True)
        self._thread.start()
        return self

    def mark(self, label: str) -> None:
        """Record the start of a phase named ``label`` (reports split utilization by phase)."""
        if self.record.available:
            with self._lock:
                self.record.marks.append(Mark(self.clock() - self._t0, label))

    def stop(self) -> MonitorRecord:
        """Stop sampling, drain the last utilization samples, close NVML; return the record."""
        if self._thread is None:
            return self.record
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.poll()
        self.record.duration_s = self.clock() - self._t0
        if self._owns_writer:
            self._writer.close()
        self._nvml.nvmlShutdown()
        return self.record

    def _run(self) -> None:
        cpu0 = time.thread_time()
        while not self._stop.wait(self.interval_s):
            self.poll()
        self.record.sampler_cpu_s += time.thread_time() - cpu0

    def _read(self, what: str, fn: Callable[[], float]) -> float | None:
        if what in self._unsupported:
            return None
        try:
            return fn()
        except Exception as exc:  # one unsupported metric must not stop the others
            self._unsupported.add(what)
            _warn_once(f"concur.monitor: {what} cannot be read on {self.record.device} ({exc}); left empty.")
            return None

    def poll(self) -> None:
        """Take one sample now (the thread calls this every ``interval_s``)."""
        if not self.record.available:
            return
        with self._lock:  # the thread and a caller may poll at once; the drain cursor is shared
            nvml, handle = self._nvml, self._handle
            t = self.clock() - self._t0
            sample = Sample(
                t_s=t,
                memory_used_mb=self._read("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20),
                sm_clock_mhz=self._read("SM clock",
                                        lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))),
                power_w=self._read("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0))
            utils = self._drain_utilization(t)
            self.record.samples.append(sample)
            self.record.utilization.extend(utils)
            if self._writer is not None:
                self._log(sample, utils)

    def _log(self, sample: Sample, utils: list[UtilizationSample]) -> None:
        step = len(self.record.samples)
        for tag in ("memory_used_mb", "sm_clock_mhz", "power_w"):
            value = getattr(sample, tag)
            if value is not None:
                self._writer.add_scalar(f"concur/{tag}", value, step, walltime=self._t0 + sample.t_s)
        for u in utils:  # step = milliseconds since start: utilization has its own, slower clock
            self._writer.add_scalar("concur/gpu_util_percent", u.gpu_percent, int(u.t_s * 1000),
                                    walltime=self._t0 + u.t_s)

    def _drain_utilization(self, now_s: float) -> list[UtilizationSample]:
        """Return the driver's utilization samples newer than the last one seen."""
        nvml = self._nvml
        if self.record.utilization_source == "rates":
            value = self._read("utilization", lambda: float(nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            return [] if value is None else [UtilizationSample(now_s, value)]
        try:
            kind, raw = nvml.nvmlDeviceGetSamples(self._handle, nvml.NVML_GPU_UTILIZATION_SAMPLES,
                                                  self._last_util_us)
        except Exception as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_FOUND", 6):
                return []  # no sample newer than the last one: normal between driver updates
            self.record.utilization_source = "rates"
            _warn_once(f"concur.monitor: nvmlDeviceGetSamples failed ({exc}); polling "
                       "nvmlDeviceGetUtilizationRates instead (values repeat between driver updates).")
            return self._drain_utilization(now_s)
        out = []
        for s in raw:
            if s.timeStamp <= self._last_util_us:
                continue
            value = getattr(s.sampleValue, _SAMPLE_FIELDS.get(kind, "uiVal"))
            out.append(UtilizationSample(s.timeStamp / 1e6 - self._t0, float(value)))
            self._last_util_us = max(self._last_util_us, s.timeStamp)
        return out

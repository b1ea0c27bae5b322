"""Pure-Python stream schedulers for DAGs of costed kernels; never imports torch.

A scheduler takes a `networkx.DiGraph` whose nodes carry a `cost` (predicted
microseconds; missing means 0) and whose edges u -> v mean "v after u", and
returns a `Schedule`: a stream per node, an issue order, and the fewest
cross-stream waits that keep every edge. See `schedulers.schedule` for the
execution model the runtime must follow.
"""

from schedulers.schedule import (
    SCHEDULERS,
    Replay,
    Schedule,
    Wait,
    build_schedule,
    minimal_waits,
    on_caller,
    replay,
    schedule,
    schedule_steps,
    simulate,
    simulate_shared,
    validate,
)
from schedulers.serial import serial
from schedulers.critical_path import critical_path
from schedulers.fork import fork
from schedulers.coarsen import Coarsened, attach_trivial, coarsen, expand
from schedulers.stream_memory import MemoryTracker, memory_budget, peak_bytes, stream_peaks
from schedulers.analysis import critical_path_length, predicted_speedups, speedup_predictions, width

__all__ = [
    "Coarsened",
    "MemoryTracker",
    "memory_budget",
    "peak_bytes",
    "stream_peaks",
    "attach_trivial",
    "coarsen",
    "expand",
    "Replay",
    "SCHEDULERS",
    "Schedule",
    "Wait",
    "build_schedule",
    "critical_path",
    "critical_path_length",
    "fork",
    "minimal_waits",
    "on_caller",
    "predicted_speedups",
    "replay",
    "schedule",
    "schedule_steps",
    "serial",
    "simulate",
    "simulate_shared",
    "speedup_predictions",
    "validate",
    "width",
]

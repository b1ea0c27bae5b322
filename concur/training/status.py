"""How a training step runs: captured or eagerly, on how many streams, and why; what its captures went through.

A step that falls back (fewer streams where several did not fit in memory,
eager execution where no capture succeeded) keeps training, and warns once;
:class:`StepStatus` says the same at any time, so that a log, the CLI and a
report can show it instead of leaving it to a warning a user may miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CaptureLog", "StepStatus"]


@dataclass
class CaptureLog:
    """What one step's captures went through: captured, failed, recovered by a retry; the fallbacks taken."""

    captures: int = 0    # graphs captured (each program of a trial counts)
    failures: int = 0    # attempts that raised (each is retried or falls back)
    recovered: int = 0   # captures that succeeded on a retry after a failure at the same stream count
    fallbacks: list[str] = field(default_factory=list)  # each fallback, in words, in order
    mode: str = "not run yet"  # how the last call ran: "captured", "eager" or "not run yet"
    streams: int | None = None  # the streams of the last call's program
    why: str = ""  # why the last call ran as it did, where that is not what was asked for


@dataclass(frozen=True)
class StepStatus:
    """How a :class:`~concur.training.step.TrainStep` ran its last call, and what its captures went through.

    >>> print(StepStatus("captured", 4, 4, "", 2, 0, 0, ()))
    captured, 4 streams (2 captures)
    >>> print(StepStatus("captured", 1, 4, "the step on 4 streams does not fit in memory", 2, 1, 0, ()))
    captured, 1 stream of 4 asked for: the step on 4 streams does not fit in memory (2 captures, 1 failed)
    """

    mode: str                 # "captured", "eager" or "not run yet"
    streams: int | None       # streams of the program the last call ran (None before the first call)
    requested: int | str      # the streams asked for: a count or "auto"
    why: str                  # why it runs otherwise than asked (fewer streams, eagerly); "" where it does not
    captures: int
    failures: int
    recovered: int
    fallbacks: tuple[str, ...]

    @property
    def captured(self) -> bool:
        return self.mode == "captured"

    def __str__(self) -> str:
        counts = f"{self.captures} capture{'s' if self.captures != 1 else ''}"
        if self.failures:
            counts += f", {self.failures} failed"
        if self.recovered:
            counts += f", {self.recovered} recovered by a retry"
        if self.mode == "not run yet":
            return "not run yet"
        plural = "s" if self.streams != 1 else ""
        streams = f"{self.streams} stream{plural}"
        if self.requested != self.streams and self.requested != "auto":
            streams += f" of {self.requested} asked for"
        head = f"captured, {streams}" if self.captured else f"eager, {streams}"
        return f"{head}: {self.why} ({counts})" if self.why else f"{head} ({counts})"

"""Peak memory of one mode in a child: over its setup and over its timed steps, allocated and reserved.

Allocated is what tensors hold (``torch.cuda.max_memory_allocated``); reserved
is what the caching allocator holds from the driver (``max_memory_reserved``),
its free blocks and CUDA-graph pools included. A captured step's pool stays
reserved but is only partly allocated between replays (blocks freed during the
capture are free in the pool, and a replay allocates nothing), so for the graph
modes reserved is the footprint a user pays.

Each peak counts from what the process held when the mode's setup began (its
model and batch already on the device), so modes set up one after another in
one child (``--together``) do not count each other's. Setup runs from building
the step through its first call (the compile or capture) and the warm-up steps
(reduce-overhead records its graphs in them). The steady peak is what the mode
holds between steps once set up plus the largest rise over a stretch of its
timed steps: the other modes of the child stay put meanwhile. Each window
starts after ``empty_cache``, so a mode's reserved memory is its live blocks'
segments and its pools, not what another mode left cached. The allocator
reserves whole segments (2 MB for small tensors, 20 MB for those up to 10 MB)
and splits them among tensors: a later mode's tensors outside a CUDA graph may
fit in the free part of a segment an earlier mode holds, so its reserved peaks
can read low by a few segments (a graph's private pool is its own).
"""

from __future__ import annotations

from dataclasses import dataclass

FIELDS = ("setup_peak_allocated_mb", "setup_peak_reserved_mb", "steady_peak_allocated_mb", "steady_peak_reserved_mb")
"""The row's fields, in MB (2**20 bytes); None without CUDA. ``peak_mb``, the name of rows made before
the reserved peaks, stays in every row as ``setup_peak_allocated_mb``."""


def _sample(reset: bool) -> tuple[int, int]:
    """(allocated, reserved) bytes now, after the queued work and with no cached free blocks."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _peaks() -> tuple[int, int]:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _mb(n: int) -> float:
    return n / 2**20


@dataclass
class MemoryPeaks:
    """One mode's memory windows; without CUDA every method does nothing and the fields stay None."""

    cuda: bool
    before: tuple[int, int] = (0, 0)  # (allocated, reserved) when the setup began
    held: tuple[int, int] = (0, 0)  # what the mode holds between steps, once set up
    rise: tuple[int, int] = (0, 0)  # the largest rise over a stretch of timed steps
    _stretch: tuple[int, int] = (0, 0)

    def begin_setup(self) -> None:
        if self.cuda:
            self.before = _sample(reset=True)

    def end_setup(self, row: dict) -> None:
        """Record the setup peaks (and ``peak_mb``) in ``row``."""
        if not self.cuda:
            return
        allocated, reserved = (p - b for p, b in zip(_peaks(), self.before))
        row.update(setup_peak_allocated_mb=_mb(allocated), setup_peak_reserved_mb=_mb(reserved),
                   peak_mb=_mb(allocated))
        self.held = tuple(n - b for n, b in zip(_sample(reset=False), self.before))

    def begin_steps(self) -> None:
        if self.cuda:
            self._stretch = _sample(reset=True)

    def end_steps(self) -> None:
        if self.cuda:
            self.rise = tuple(max(r, p - s) for r, p, s in zip(self.rise, _peaks(), self._stretch))

    def record_steady(self, row: dict) -> None:
        """Record the steady peaks in ``row``: held between steps plus the largest rise over timed steps."""
        if self.cuda:
            row.update(steady_peak_allocated_mb=_mb(self.held[0] + self.rise[0]),
                       steady_peak_reserved_mb=_mb(self.held[1] + self.rise[1]))

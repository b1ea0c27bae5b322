"""An unfused captured step decides its streams on the user's own first steps.

Timing a plan before the step (:mod:`concur.fx.plan_timing`) captures each
program's forward and backward in a graph of its own, warms each up and
replays each a few dozen times: about half again a setup's time, where the
measured decisions may add at most 10%. Here each program is captured once, as the whole
step it would be: the capture the step makes anyway, and one more for the
one-stream program. The first calls then replay the programs, each a real
training step (all of them compute the same step from the same parameters,
optimizer state and generators), each replay timed with CUDA events on the
caller's stream, so the timing costs no replay of its own. Once the rounds
say what :func:`concur.dag.decide.choose` needs, the faster program stays
and the others are freed; the decision is cached like any other, so the
next run builds the chosen plan and captures once.

By default (:class:`OneAtATime`) the predicted program is captured alone and
replayed by :data:`PHASE` calls, then freed, and the one-stream program is
captured in a fresh pool for as many: setup holds one program's pool at a
time. With :data:`SIDE_BY_SIDE` on (:class:`StepTrial`), every candidate is
captured at once and the calls alternate between them, rounds as
:func:`concur.dag.measure.replay_rounds` times them: round ``r`` replays each
program :data:`REPLAYS` times in a row, in an order rotated by ``r``, and
gives one time per program (the mean of its replays). Round 0 is not
counted: a graph's first replays upload it and run on cold caches. Times are
read only once their events have completed. Until enough rounds are issued
to decide (:data:`concur.dag.decide.SETTLED_ROUNDS` counted), no call waits
for the device; from then on the call that ends a round waits for its last
replay, once per round. Without that wait the host runs ahead and the
programs keep alternating until the device catches up, many calls past
the ones that decided. Where every program at once does not fit in memory,
the step times them one at a time instead.

Side by side, the programs share the step's memory pool, the one-stream
program captured first, so that the others' caller-stream buffers reuse its
blocks (:func:`concur.training.capture.capture_trial`). Where one stream
wins, the step drops every graph and captures again in a fresh pool, warming
up once: the pool would otherwise keep the multi-stream programs'
side-stream blocks reserved for the life of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from concur.dag import decide, measure

__all__ = ["StepTrial", "OneAtATime", "SIDE_BY_SIDE", "PHASE", "REPLAYS", "ROUNDS", "several_ranks"]


REPLAYS = 2             # replays of one program in a row, per round
ROUNDS = measure.ROUNDS  # counted rounds at most; fewer where decide.settled says more would not change it


class ReplayTiming(Protocol):
    """One timed replay (:meth:`concur.training.graph_runner.CudaGraphRunner.timed_replay`)."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def ms(self) -> float: ...


@dataclass
class StepTrial:
    """The programs of one input shape, replayed in turn by the step's calls until their rounds decide.

    ``programs`` are the step's graphs (:class:`concur.training.graph_runner.Captured`)
    in the order of a timed round: one stream first, then each candidate.
    """

    key: tuple
    programs: list[Any]
    device: Any = None  # the GPU they run on (a torch.device), asked who else works there when they have decided
    timings: list[list[ReplayTiming]] = field(default_factory=list)  # per round, per program: its replays
    _calls: int = 0

    def next_program(self) -> tuple[int, Any]:
        """Return the index and graph of the program this call replays."""
        n = len(self.programs)
        r, k = divmod(self._calls, n * REPLAYS)
        if k == 0:
            self.timings.append([[] for _ in range(n)])
        i = (r + k // REPLAYS) % n  # program order rotated by the round
        self._calls += 1
        return i, self.programs[i]

    def replayed(self, i: int, timing: ReplayTiming) -> None:
        """Record the timing of this call's replay of program ``i``."""
        self.timings[-1][i].append(timing)

    def rounds(self) -> list[tuple[float, ...]]:
        """Return the counted rounds whose replays have all completed: per round, ms per replay of each program."""
        out: list[tuple[float, ...]] = []
        for round_ in self.timings[1:]:
            if any(len(replays) < REPLAYS or not all(t.done() for t in replays) for replays in round_):
                break
            out.append(tuple(sum(t.ms() for t in replays) / len(replays) for replays in round_))
        return out

    def decided(self) -> list[tuple[float, ...]] | None:
        """Return the rounds to decide on once there are enough (:data:`ROUNDS`, or settled sooner), else None.

        Where the last call ended a round and enough counted rounds are
        issued to settle, first wait for that round's last replay.
        """
        n = len(self.programs)
        issued, ended = divmod(self._calls, n * REPLAYS)
        if ended == 0 and issued - 1 >= decide.SETTLED_ROUNDS:  # round 0 is not counted
            self.timings[-1][(issued - 1 + n - 1) % n][-1].wait()  # the round's last program, its last replay
        rounds = self.rounds()
        if len(rounds) >= ROUNDS or (rounds and decide.settled(rounds)):
            return decide.TimedRounds(rounds[:ROUNDS], measure.others_timing_beside(self.device))
        return None


PHASE = 1 + ROUNDS  # the calls that replay one program of a trial one program at a time; the first not counted

# How an unfused step's first calls time its programs where every one would fit: one at a time (:class:`OneAtATime`:
# setup holds one program's pool at a time), or side by side (every candidate captured at once, in one pool; rounds
# alternate, so a drift on the device counts against none of them, but setup then holds the one-stream program's
# blocks and the others' side-stream blocks together, which the side streams cannot give back to the caller's).
# Off: both ways kept the same programs at the same speed where they were compared, side by side with more memory
# (the docs' results). Read at each trial's start; ``experiments/memory.py --trial`` measures either way.
SIDE_BY_SIDE = False


@dataclass
class OneAtATime:
    """The predicted program, then the one-stream program, each captured alone and replayed by :data:`PHASE` of
    the step's calls: the default, and the way where the programs do not fit in memory side by side.

    A plan kept on its prediction alone can be slower than one stream where
    the device is short of memory (the docs' results have a case); so under
    pressure too the decision is timed, at the price of a capture or two
    more. The predicted program, captured already, goes first; at
    :meth:`one_stream_due` the step frees it and captures the one-stream
    program in a new pool. Round ``i`` pairs the ``i``-th counted replay of
    each (one stream first, as :class:`StepTrial`'s rounds): not
    alternating, so a drift between the two halves counts too, but a clear
    answer is what it is for. Cached only where :data:`SIDE_BY_SIDE` is off
    and the predicted candidate is the only one (``streams="auto"``, which
    narrows several candidates to one by prediction, times again each run)
    (:meth:`concur.fx.plan_timing.PendingChoice.predicted_alone`).
    """

    key: tuple
    programs: list[Any]  # the one-stream program's graph (None until captured), the predicted one's (None once freed)
    device: Any = None
    timings: list[list[ReplayTiming]] = field(default_factory=lambda: [[], []])  # per program: its replays
    _calls: int = 0

    def one_stream_due(self) -> bool:
        """Whether this call is the first of the one-stream program's, which the step captures first."""
        return self._calls == PHASE and self.programs[0] is None

    def next_program(self) -> tuple[int, Any]:
        """Return the index and graph of the program this call replays."""
        i = 1 if self._calls < PHASE else 0
        self._calls += 1
        return i, self.programs[i]

    def replayed(self, i: int, timing: ReplayTiming) -> None:
        """Record the timing of this call's replay of program ``i``."""
        self.timings[i].append(timing)

    def decided(self) -> list[tuple[float, ...]] | None:
        """Return the rounds once both programs have had their calls (waiting for the last replay), else None."""
        if self._calls < 2 * PHASE:
            return None
        self.timings[0][-1].wait()
        rounds = [(one.ms(), other.ms()) for one, other in zip(self.timings[0][1:], self.timings[1][1:])]
        return decide.TimedRounds(rounds, measure.others_timing_beside(self.device))


def several_ranks() -> bool:
    """Whether this process is one of several distributed ranks (they must all run the same program)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

"""Whether a graph runs on several streams: the one decision every route makes, made here.

The fx path (:mod:`concur.fx.module`), the backend's wrapper route
(:mod:`concur.inductor.placement`) and its stamped route
(:mod:`concur.inductor.stamp`) each hold a costed DAG of their own ops. Each
calls, in this order:

1. :func:`schedule_graph`: coarsen the DAG into clusters worth a stream
   switch (fused kernels: :data:`MIN_CLUSTER_LAUNCHES` launches' worth each;
   the fx path schedules op by op), schedule, expand back;
2. :func:`predict`: one stream's predicted time against the schedule's, with
   kernels sharing the device (:func:`schedulers.simulate_shared`);
3. :func:`decide`: keep the multi-stream program or drop it for one stream.

The decision, one threshold for every route::

    schedule uses one stream              -> one stream
    predicted speedup < min_speedup       -> one stream (nothing is timed)
    no timer (no GPU)                     -> several streams: the prediction decides
    a cached measurement for this key     -> what it measured
    timed: median of the rounds           -> several streams only if faster than one
                                             stream by more than ``margin``

:func:`choose` makes the same decision among several multi-stream programs of
one graph (``streams="auto"``: its schedules on 2, 3 and 4 streams), all
timed in the same alternating rounds: the fastest, or the fewest streams
within ``margin`` of it, against one stream as above; without a timer, the
fewest streams predicted within :data:`PREDICTED_TIE` of the best.

The prediction is only a filter: on networks it was never tuned for it is off
by 20-50% (experiments/RESULTS.md), so where a GPU can time both programs, the measurement
decides, and equal times keep one stream. The timer is passed in (on CUDA:
:func:`concur.dag.measure.alternating_replays`), so this module stays pure and
is tested with faked timings. Each decision logs one INFO line on the
``concur`` logger with the times it rests on.

>>> import networkx as nx
>>> dag = nx.DiGraph([("x", "a"), ("x", "b"), ("a", "y"), ("b", "y")])
>>> nx.set_node_attributes(dag, {"x": 1.0, "a": 10.0, "b": 10.0, "y": 1.0}, "cost")
>>> p = predict(dag, schedule_graph(dag, streams=2, scheduler="critical_path"))
>>> p.num_streams, p.serial_us, p.streams_us    # 1 + 10 + 1, plus two waits of 1 us each
(2, 22.0, 14.0)
>>> slower = lambda: [(1.0, 1.2)] * 5    # one stream 1.0 ms, two streams 1.2 ms
>>> decide("a diamond", p, timer=slower).keep
False
"""

from __future__ import annotations

import hashlib
import logging
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import networkx as nx

import schedulers

from concur.errors import failure_text

log = logging.getLogger("concur")

MIN_CLUSTER_LAUNCHES = 2  # a stream switch must be worth about this many launches (an event each way)
MIN_SPEEDUP = 1.0         # a program predicted slower than one stream is never kept, nor timed
MARGIN = 0.01             # measured: several streams must beat one by this fraction, else one stream

SETTLED_ROUNDS = 3        # a timing may stop after this many rounds if each gave the same clear answer (settled)
PREDICTED_TIE = 0.03      # without a timer, "auto" takes the fewest streams predicted within this of the best
AUTO = "auto"
AUTO_STREAMS = (2, 3, 4)  # the stream counts streams="auto" weighs against one stream

# The rounds a timer returns: per round, (one stream, several streams), ms of one replay each; with several
# candidates (choose), (one stream, candidate 0, candidate 1, ...).
Timer = Callable[[], Sequence[tuple[float, ...]]]


class TimedRounds(list):
    """A timer's rounds, and how many other processes had work on the GPU as they were timed (None: unknown).

    Their kernels share the device with the timed replays and can turn the
    answer (ResNeSt-14d's step measured 0.65x on streams beside compiling
    neighbours, 1.04x alone). Such a decision is stored, so it can be read
    (``concur cache list``), but not reused: a later run times again.
    """

    def __init__(self, rounds: Sequence[tuple[float, ...]] = (), others: int | None = None):
        super().__init__(rounds)
        self.others = others


def schedule_graph(dag: nx.DiGraph, streams: int, scheduler: str, cluster_cost_us: float | None = None,
                   memory_budget: int | None = None, training_memory: bool = False) -> schedulers.Schedule:
    """Return ``dag`` scheduled on up to ``streams`` streams, in clusters worth ``cluster_cost_us`` each.

    Fused kernels come by the hundred around a few heavy ones, so the
    backend's routes coarsen first (:func:`schedulers.coarsen`: one cluster
    per branch, none cheaper than ``cluster_cost_us``) and expand the
    cluster schedule back; ``None`` schedules node by node (the fx path,
    whose code generator places each op's events itself). With
    ``memory_budget`` (bytes, :mod:`concur.dag.memory_budget`) the critical-path
    scheduler keeps the streams' memory within it (:mod:`schedulers.stream_memory`); with
    ``training_memory`` the budget covers a training step's backward too (saved activations a side stream
    made count again: the caller's stream cannot reuse them).
    On one stream the schedule is the program's order (:func:`schedulers.serial`).
    """
    if streams <= 1:
        # One stream runs the program's own order (eager PyTorch's, inductor's), whatever the scheduler: a
        # list schedule's order interleaves branches, so a kernel reads back from DRAM the input the
        # program's order leaves in L2 (on the H200, unfused GoogLeNet b64's BatchNorm statistics ran 10%
        # slower in a critical-path order, the step 1.2% slower than the recipe).
        return schedulers.schedule(dag, 1, "serial")
    kw = {} if memory_budget is None or scheduler != "critical_path" else \
        {"memory_budget": memory_budget, "training_memory": training_memory}
    if cluster_cost_us is None:
        return schedulers.schedule(dag, streams, scheduler, **kw)
    coarse = schedulers.coarsen(dag, min_cost=cluster_cost_us)
    return schedulers.expand(dag, coarse, schedulers.schedule(coarse.dag, streams, scheduler, **kw))


def stream_counts(streams: int | str | Sequence[int]) -> tuple[int, ...]:
    """Return the stream counts a route schedules for ``streams``: ``"auto"`` gives :data:`AUTO_STREAMS`."""
    if streams == AUTO:
        return AUTO_STREAMS
    return (streams,) if isinstance(streams, int) else tuple(streams)


def distinct_schedules(dag: nx.DiGraph, counts: Sequence[int], scheduler: str,
                       cluster_cost_us: float | None = None, memory_budget: int | None = None,
                       training_memory: bool = False) -> list[schedulers.Schedule]:
    """Return :func:`schedule_graph` of ``dag`` on each of ``counts`` streams, schedules that coincide once.

    The candidates :func:`choose` weighs: a graph of two branches schedules
    alike on 2, 3 and 4 streams, and is one program to time, not three.
    """
    distinct: dict[tuple, schedulers.Schedule] = {}
    for k in counts:
        s = schedule_graph(dag, k, scheduler, cluster_cost_us, memory_budget, training_memory)
        distinct.setdefault(s.placement, s)
    return list(distinct.values())


@dataclass(frozen=True)
class Prediction:
    """Predicted time of a schedule against one stream (µs), ideal and with kernels sharing the device."""

    num_streams: int
    serial_us: float    # one stream: the sum of the costs
    ideal_us: float     # the schedule, each kernel as fast as alone (a bound)
    streams_us: float   # the schedule, concurrent kernels sharing the device

    @property
    def ideal_speedup(self) -> float:
        """Return one stream's time over the schedule's ideal makespan (1.0 for an empty graph)."""
        return self.serial_us / self.ideal_us if self.ideal_us > 0 else 1.0

    @property
    def speedup(self) -> float:
        """Return one stream's time over the schedule's, kernels sharing the device (1.0 for an empty graph)."""
        return self.serial_us / self.streams_us if self.streams_us > 0 else 1.0


def predict(dag: nx.DiGraph, schedule: schedulers.Schedule) -> Prediction:
    """Return the :class:`Prediction` of ``schedule`` for ``dag``."""
    serial_us = sum(float(dag.nodes[v].get("cost") or 0.0) for v in dag)
    shared = schedulers.simulate_shared(dag, schedule) if schedule.num_streams > 1 else serial_us
    return Prediction(schedule.num_streams, serial_us, schedule.makespan, shared)


def together(predictions: Sequence[Prediction]) -> Prediction:
    """Return the prediction of several graphs run one after another (a training step's forward and backward)."""
    return Prediction(max((p.num_streams for p in predictions), default=1), sum(p.serial_us for p in predictions),
                      sum(p.ideal_us for p in predictions), sum(p.streams_us for p in predictions))


@dataclass(frozen=True)
class Measured:
    """Median times of one replay (ms) of the one-stream and the multi-stream program, alternated."""

    one_stream_ms: float
    streams_ms: float     # the chosen candidate's (the only one's, where there was one)
    rounds: int
    candidates_ms: tuple[float, ...] = ()  # every candidate's median, where several were timed

    @property
    def speedup(self) -> float:
        """Return the one-stream median over the multi-stream median."""
        return self.one_stream_ms / self.streams_ms if self.streams_ms > 0 else 1.0


@dataclass(frozen=True)
class Decision:
    """Whether to run the multi-stream program, and what that rests on."""

    keep: bool                   # run the multi-stream program (False: one stream)
    prediction: Prediction
    measured: Measured | None    # None where nothing was timed (nor read from the cache)
    source: str                  # "prediction", "measurement" or "cache"
    reason: str                  # one sentence: what was compared with what
    candidate: int = 0           # which of the candidates given to choose() the prediction and times are of

    @property
    def num_streams(self) -> int:
        """Return the number of streams that run: the schedule's if kept, else 1."""
        return self.prediction.num_streams if self.keep else 1


class DecisionCache(Protocol):
    """Where measured decisions are kept between runs (:class:`concur.dag.disk_cache.JsonCache`)."""

    def get(self, key: str) -> dict | None: ...

    def put(self, key: str, result: dict) -> Any: ...


def decision_key(*parts: Any) -> str:
    """Return a hex digest of ``parts``: what a measured decision depends on (each part by its ``repr``).

    The routes pass the graph (its code), every input's shape, stride and
    dtype, the plan, the device and the torch version, so that a changed
    model, batch size or dtype finds no stale decision.
    """
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def medians(rounds: Sequence[tuple[float, ...]], programs: int) -> list[float]:
    """Return each program's median over a timer's rounds of ``programs`` times each.

    Raises:
        ValueError: no round was timed, or a round has another number of times.
    """
    if not rounds:
        raise ValueError("the timer returned no rounds")
    if any(len(r) != programs for r in rounds):
        raise ValueError(f"the timer returned rounds of {sorted({len(r) for r in rounds})} times, not {programs}")
    return [statistics.median(r[i] for r in rounds) for i in range(programs)]


def settled(rounds: Sequence[tuple[float, ...]], margin: float = MARGIN) -> bool:
    """Whether rounds timed so far (one stream first in each) already give the decision more rounds would give.

    True after :data:`SETTLED_ROUNDS` or more rounds where every round says
    the same with room to spare: every candidate slower than one stream
    (dropped, whichever candidate is best), or the fastest candidate faster
    by twice ``margin`` with the same candidates within ``margin`` of it in
    every round and the others beyond twice ``margin`` (``"auto"``'s pick,
    the fewest streams among those within the margin, is then the same in
    every round). In between, all the rounds are timed: there the median
    decides by a little, and a round is a setup cost of a few steps per
    program.
    """
    if len(rounds) < SETTLED_ROUNDS or any(len(r) < 2 or r[0] <= 0 for r in rounds):
        return False
    ratios = [min(r[1:]) / r[0] for r in rounds]  # best candidate over one stream, per round
    if all(x > 1.0 for x in ratios):
        return True
    if not all(x < 1 - 2 * margin for x in ratios):
        return False
    near = set()
    for r in rounds:
        within = near_fastest(r[1:], margin)
        if within != near_fastest(r[1:], 2 * margin):
            return False  # a candidate in the band between: which side it falls on is the median's call
        near.add(within)
    return len(near) == 1


def near_fastest(times: Sequence[float], margin: float = MARGIN) -> frozenset[int]:
    """Return the positions of the times within ``margin`` of the fastest: the candidates ``"auto"`` picks among."""
    fastest = min(times)
    return frozenset(j for j, t in enumerate(times) if t <= fastest * (1 + margin))


def decide(what: str, prediction: Prediction, *, min_speedup: float = MIN_SPEEDUP, timer: Timer | None = None,
           cache: DecisionCache | None = None, key: str | None = None, margin: float = MARGIN,
           scope: str = "graph") -> Decision:
    """Return whether ``what`` runs its multi-stream program (see the module docstring), logging why.

    ``timer`` times the one-stream and the multi-stream program against
    each other; a timer that raises leaves the decision to the prediction
    (the log line says why). A measurement is stored in ``cache`` under
    ``key`` and read back instead of timing again, with ``scope``:
    ``"graph"`` (one compiled graph) or ``"step"`` (the graphs of a captured
    step, :mod:`concur.training.step_streams`), which the calibration keeps
    apart.
    """
    return choose(what, [prediction], min_speedup=min_speedup, timer=timer, cache=cache, key=key, margin=margin,
                  scope=scope)


def choose(what: str, candidates: Sequence[Prediction], *, min_speedup: float = MIN_SPEEDUP,
           timer: Timer | None = None, cache: DecisionCache | None = None, key: str | None = None,
           margin: float = MARGIN, scope: str = "graph") -> Decision:
    """Return which of several multi-stream programs of ``what`` runs, or one stream, logging why.

    :func:`decide` with one candidate. Candidates on one stream or
    predicted below ``min_speedup`` are not timed; ``timer`` times one
    stream and the others (:func:`timed_candidates`), in that order, in each round. The decision's
    ``candidate`` is the index of the chosen program in ``candidates``.

    Raises:
        ValueError: no candidate (a concur bug).
    """
    if not candidates:
        raise ValueError("choose() was given no candidate program (a concur bug, please report it)")
    return _logged(what, _choose(what, list(candidates), min_speedup, timer, cache, key, margin, scope))


def _logged(what: str, decision: Decision) -> Decision:
    """Log the one INFO line of ``decision``; return it."""
    if decision.keep:
        log.info("concur: %s runs on %d streams: %s", what, decision.num_streams, decision.reason)
    else:
        log.info("concur: %s runs on one stream: %s", what, decision.reason)
    return decision


def _predicted(p: Prediction) -> str:
    return (f"predicted {p.serial_us:,.1f} us on one stream against {p.streams_us:,.1f} us on "
            f"{p.num_streams} ({p.speedup:.2f}x, kernels sharing the device)")


def by_prediction(ps: Sequence[Prediction]) -> int:
    """Index of the fewest streams predicted within :data:`PREDICTED_TIE` of the best prediction."""
    best = max(p.speedup for p in ps)
    return min((i for i, p in enumerate(ps) if p.speedup >= best * (1 - PREDICTED_TIE)),
               key=lambda i: (ps[i].num_streams, -ps[i].speedup))


def timed_candidates(candidates: Sequence[Prediction], min_speedup: float = MIN_SPEEDUP) -> list[int]:
    """Return the indices of the candidates :func:`choose` times, in the order its timer must time them.

    Those on several streams predicted at least ``min_speedup`` (a makespan
    summed in another order is not slower).
    """
    return [i for i, p in enumerate(candidates) if p.num_streams > 1 and p.speedup >= min_speedup * (1 - 1e-9)]


def _choose(what: str, candidates: list[Prediction], min_speedup: float, timer: Timer | None,
            cache: DecisionCache | None, key: str | None, margin: float, scope: str) -> Decision:
    several = [i for i, p in enumerate(candidates) if p.num_streams > 1]
    if not several:
        return Decision(False, candidates[0], None, "prediction", "the schedule uses one stream")
    worth = timed_candidates(candidates, min_speedup)
    if not worth:
        best = max(several, key=lambda i: candidates[i].speedup)
        return Decision(False, candidates[best], None, "prediction",
                        f"{_predicted(candidates[best])}, below {min_speedup:g}x", best)
    if timer is None:
        i = worth[by_prediction([candidates[i] for i in worth])]
        return Decision(True, candidates[i], None, "prediction",
                        f"{_predicted(candidates[i])}; not timed (no GPU to time it on)", i)
    stored = _stored(candidates, cache, key, margin)
    if stored is not None:
        return stored
    try:
        rounds = timer()
        one, *times = medians(rounds, 1 + len(worth))
    except Exception as exc:  # noqa: BLE001 - a program that cannot be timed is judged as without a GPU
        i = worth[by_prediction([candidates[i] for i in worth])]
        return Decision(True, candidates[i], None, "prediction",
                        f"{_predicted(candidates[i])}; timing failed ({failure_text(exc)})", i)
    # the fewest streams within the margin of the fastest: as fast, with fewer streams' memory and launches
    pick = min(near_fastest(times, margin), key=lambda j: (candidates[worth[j]].num_streams, times[j]))
    i, p = worth[pick], candidates[worth[pick]]
    m = Measured(one, times[pick], len(rounds), tuple(times) if len(times) > 1 else ())
    keep = m.streams_ms < m.one_stream_ms * (1 - margin)
    others = getattr(rounds, "others", None)
    if cache is not None and key is not None:
        # the prediction's terms ride along: experiments/calibrate.py fits the prediction to these entries
        entry = {"keep": keep, "one_stream_ms": m.one_stream_ms, "streams_ms": m.streams_ms,
                 "rounds": m.rounds, "predicted_speedup": p.speedup, "ideal_speedup": p.ideal_speedup,
                 "serial_us": p.serial_us, "streams_us": p.streams_us, "num_streams": p.num_streams,
                 "what": what, "scope": scope}
        if len(candidates) > 1:
            entry.update(candidate=i, candidates_ms=list(m.candidates_ms))
        if others:
            entry["other_processes"] = others  # stored to be read, never reused (_stored)
        cache.put(key, entry)
    beside = (f"; timed beside {others} other process{'es' if others > 1 else ''} on the GPU, so a later run "
              f"times it again") if others else ""
    return Decision(keep, p, m, "measurement", f"{_compared(m, keep, margin, p)}; {_predicted(p)}{beside}", i)


def cached_choice(what: str, candidates: Sequence[Prediction], cache: DecisionCache, key: str,
                  margin: float = MARGIN) -> Decision | None:
    """Return the measured decision among ``candidates`` that ``cache`` holds under ``key``, logged; else None.

    For a caller that times later than it builds (``train_step``'s first
    steps, :mod:`concur.training.trial`): a decision measured before is
    taken now, as :func:`choose` would take it, and only a new one waits
    for the timing, which then goes through :func:`choose`.
    """
    decision = _stored(list(candidates), cache, key, margin)
    return None if decision is None else _logged(what, decision)


def _stored(candidates: list[Prediction], cache: DecisionCache | None, key: str | None,
            margin: float) -> Decision | None:
    stored = cache.get(key) if cache is not None and key is not None else None
    if not isinstance(stored, dict) or stored.get("other_processes"):  # none, or timed beside other work: again
        return None
    try:
        i = int(stored.get("candidate", 0))
        m = Measured(float(stored["one_stream_ms"]), float(stored["streams_ms"]), int(stored["rounds"]),
                     tuple(float(t) for t in stored.get("candidates_ms", ())))
        keep = bool(stored["keep"])
        p = candidates[i]
    except (KeyError, TypeError, ValueError, IndexError):
        return None  # an entry of another format: time again
    return Decision(keep, p, m, "cache", f"{_compared(m, keep, margin, p)} (cached measurement); {_predicted(p)}", i)


def _compared(m: Measured, keep: bool, margin: float, p: Prediction) -> str:
    verdict = "faster" if keep else f"not faster by {margin:.0%}"
    others = (f"; the candidates measured {', '.join(f'{t:.3f}' for t in m.candidates_ms)} ms"
              if m.candidates_ms else "")
    return (f"measured {m.streams_ms:.3f} ms on {p.num_streams} streams against {m.one_stream_ms:.3f} ms on one "
            f"stream ({m.speedup:.2f}x, median of {m.rounds} alternating rounds: {verdict}){others}")

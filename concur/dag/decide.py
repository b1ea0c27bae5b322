"""Whether a graph runs on several streams: the one decision every route makes, made here.

The fx path (:mod:`concur.fx.module`), the backend's wrapper route
(:mod:`concur.inductor.wrapper_emit`) and its stamped route
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

The prediction is only a filter: on networks it was never tuned for it is off
by 20-50% (issue 29), so where a GPU can time both programs, the measurement
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

log = logging.getLogger("concur")

MIN_CLUSTER_LAUNCHES = 2  # a stream switch must be worth about this many launches (an event each way)
MIN_SPEEDUP = 1.0         # a program predicted slower than one stream is never kept, nor timed
MARGIN = 0.01             # measured: several streams must beat one by this fraction, else one stream

# The rounds a timer returns: per round, (one stream, several streams), ms of one replay each.
Timer = Callable[[], Sequence[tuple[float, float]]]


def schedule_graph(dag: nx.DiGraph, streams: int, scheduler: str, cluster_cost_us: float | None = None
                   ) -> schedulers.Schedule:
    """Return ``dag`` scheduled on up to ``streams`` streams, in clusters worth ``cluster_cost_us`` each.

    Fused kernels come by the hundred around a few heavy ones, so the
    backend's routes coarsen first (:func:`schedulers.coarsen`: one cluster
    per branch, none cheaper than ``cluster_cost_us``) and expand the
    cluster schedule back; ``None`` schedules node by node (the fx path,
    whose code generator places each op's events itself).
    """
    if cluster_cost_us is None:
        return schedulers.schedule(dag, streams, scheduler)
    coarse = schedulers.coarsen(dag, min_cost=cluster_cost_us)
    return schedulers.expand(dag, coarse, schedulers.schedule(coarse.dag, streams, scheduler))


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
    streams_ms: float
    rounds: int

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


def measured(rounds: Sequence[tuple[float, float]]) -> Measured:
    """Return the medians of a timer's rounds.

    Raises:
        ValueError: no round was timed.
    """
    if not rounds:
        raise ValueError("the timer returned no rounds")
    return Measured(statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds), len(rounds))


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
    decision = _decide(what, prediction, min_speedup, timer, cache, key, margin, scope)
    if decision.keep:
        log.info("concur: %s runs on %d streams: %s", what, decision.num_streams, decision.reason)
    else:
        log.info("concur: %s runs on one stream: %s", what, decision.reason)
    return decision


def _decide(what: str, p: Prediction, min_speedup: float, timer: Timer | None, cache: DecisionCache | None,
            key: str | None, margin: float, scope: str) -> Decision:
    predicted = (f"predicted {p.serial_us:,.1f} us on one stream against {p.streams_us:,.1f} us on "
                 f"{p.num_streams} ({p.speedup:.2f}x, kernels sharing the device)")
    if p.num_streams <= 1:
        return Decision(False, p, None, "prediction", "the schedule uses one stream")
    if p.speedup < min_speedup * (1 - 1e-9):  # a makespan summed in another order is not slower
        return Decision(False, p, None, "prediction", f"{predicted}, below {min_speedup:g}x")
    if timer is None:
        return Decision(True, p, None, "prediction", f"{predicted}; not timed (no GPU to time it on)")
    stored = cache.get(key) if cache is not None and key is not None else None
    if stored is not None:
        try:
            m = Measured(float(stored["one_stream_ms"]), float(stored["streams_ms"]), int(stored["rounds"]))
            keep = bool(stored["keep"])
        except (KeyError, TypeError, ValueError):
            pass  # an entry of another format: time again
        else:
            return Decision(keep, p, m, "cache", f"{_compared(m, keep, margin)} (cached measurement); {predicted}")
    try:
        m = measured(timer())
    except Exception as exc:  # noqa: BLE001 - a program that cannot be timed is judged as without a GPU
        why = (str(exc).splitlines() or [""])[0][:200]
        return Decision(True, p, None, "prediction", f"{predicted}; timing failed ({type(exc).__name__}: {why})")
    keep = m.streams_ms < m.one_stream_ms * (1 - margin)
    if cache is not None and key is not None:
        # the prediction's terms ride along: experiments/calibrate.py fits the prediction to these entries
        cache.put(key, {"keep": keep, "one_stream_ms": m.one_stream_ms, "streams_ms": m.streams_ms,
                        "rounds": m.rounds, "predicted_speedup": p.speedup, "ideal_speedup": p.ideal_speedup,
                        "serial_us": p.serial_us, "streams_us": p.streams_us, "num_streams": p.num_streams,
                        "what": what, "scope": scope})
    return Decision(keep, p, m, "measurement", f"{_compared(m, keep, margin)}; {predicted}")


def _compared(m: Measured, keep: bool, margin: float) -> str:
    verdict = "faster" if keep else f"not faster by {margin:.0%}"
    return (f"measured {m.streams_ms:.3f} ms against {m.one_stream_ms:.3f} ms on one stream "
            f"({m.speedup:.2f}x, median of {m.rounds} alternating rounds: {verdict})")

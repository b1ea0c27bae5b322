"""Pick the stream count and scheduler of a training step by building and timing a step per configuration.

Two signals, two questions:

- *Which lever.* NVML utilization of the eager loop: low (the GPU waits for
  the CPU to launch kernels) means capturing a CUDA graph is what pays; high
  means the GPU is already busy and streams are the lever. Under a graph
  utilization reads ~100% whatever the stream count, so it cannot choose one.
- *How many streams.* Measured step time: median of repeats, with the noise
  of that median estimated from their spread.

The search, pure and testable with a fake timer::

    serial graph (streams=1)          baseline, always measured first
    2, 3, ... streams                 stop when k does not beat the best so far by more than noise
    other schedulers at the best k    keep one only if it beats the best by more than noise
    eager at the best k               only when the eager loop already kept the GPU busy

A configuration replaces the best only when it is faster by more than the
noise (and by at least ``min_gain``), so equal times keep fewer streams, and
the choice is never slower than the serial graph: if nothing beats it, it
stays. The choice is cached on disk (:mod:`concur.observe.tune_cache`).
"""

from __future__ import annotations

import copy
import gc
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence, TextIO

from concur.observe.tune_cache import TunerCache, cache_key, clear_cache, default_cache_dir

__all__ = ["Config", "Measurement", "Trial", "TuneResult", "beats", "lever_for", "tune", "tune_train_step",
           "cached_result", "TunerCache", "cache_key", "clear_cache", "default_cache_dir", "Progress"]

LAUNCH_BOUND_UTILIZATION = 60.0  # percent: below it, the eager GPU idles waiting for launches


@dataclass(frozen=True)
class Config:
    """One way to run the training step."""

    streams: int
    scheduler: str = "critical_path"
    cuda_graph: bool = True

    @property
    def label(self) -> str:
        """Return a short human-readable name, e.g. '4 streams, critical_path, graph'."""
        s = "1 stream" if self.streams == 1 else f"{self.streams} streams"
        return f"{s}, {self.scheduler}, {'graph' if self.cuda_graph else 'eager'}"


@dataclass(frozen=True)
class Measurement:
    """Step time of ``repeats`` timed steps: median and interquartile range (ms).

    The timer computes both (by default :func:`concur.observe.timing.time_cuda_ms`,
    whose statistics are ``torch.utils.benchmark``'s); this record adds what the
    search needs and torch does not give, the noise of the median
    (:attr:`stderr_ms`), and is what the cache and ``concur report`` store.
    """

    median_ms: float
    iqr_ms: float
    repeats: int
    notes: tuple[str, ...] = ()

    @property
    def stderr_ms(self) -> float:
        """Standard error of the median, from the IQR: 1.2533 * (IQR / 1.349) / sqrt(n).

        The IQR is the spread of single steps; the median of n of them
        wanders by about this much between two measurements of the same
        configuration.
        """
        return 0.929 * self.iqr_ms / math.sqrt(max(self.repeats, 1))


def beats(a: Measurement, b: Measurement, *, min_gain: float = 0.01, z: float = 2.0) -> bool:
    """Return True when ``a`` is faster than ``b`` by more than noise and by at least ``min_gain``.

    Noise is ``z`` standard errors of the difference of the two medians. The
    relative floor ``min_gain`` is there because two measurements taken
    seconds apart also differ by clock and temperature drift, which repeats
    within one measurement do not see.
    """
    margin = max(z * math.hypot(a.stderr_ms, b.stderr_ms), min_gain * b.median_ms)
    return a.median_ms < b.median_ms - margin


def lever_for(eager_utilization: float | None) -> str:
    """Return 'capture' (launch-bound eager loop), 'streams' (GPU already busy) or 'unknown'."""
    if eager_utilization is None:
        return "unknown"
    return "capture" if eager_utilization < LAUNCH_BOUND_UTILIZATION else "streams"


@dataclass(frozen=True)
class Trial:
    """One measured configuration, or the error that stopped it."""

    config: Config
    measurement: Measurement | None
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class TuneResult:
    """The chosen configuration, the serial-graph baseline and every trial on the way."""

    config: Config
    measurement: Measurement | None
    baseline: Measurement | None
    trials: tuple[Trial, ...] = ()
    stopped: str = ""
    lever: str = "unknown"
    eager_utilization: float | None = None
    eager: Measurement | None = None
    key: str | None = None
    from_cache: bool = False
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def speedup(self) -> float | None:
        """Serial-graph step time over the chosen one (1.0 when serial was kept)."""
        if self.baseline is None or self.measurement is None:
            return None
        return self.baseline.median_ms / self.measurement.median_ms

    def to_dict(self) -> dict:
        """Return a JSON-ready dict (see :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TuneResult:
        """Rebuild a result written by :meth:`to_dict`."""
        meas = lambda m: None if m is None else Measurement(m["median_ms"], m["iqr_ms"], m["repeats"],  # noqa: E731
                                                             tuple(m.get("notes", ())))
        trials = tuple(Trial(Config(**t["config"]), meas(t["measurement"]), t["error"], t["seconds"])
                       for t in d.get("trials", ()))
        return cls(Config(**d["config"]), meas(d["measurement"]), meas(d["baseline"]), trials,
                   d.get("stopped", ""), d.get("lever", "unknown"), d.get("eager_utilization"),
                   meas(d.get("eager")), d.get("key"), d.get("from_cache", False), d.get("seconds", 0.0),
                   tuple(d.get("notes", ())))


class Progress:
    """A one-line progress bar on stderr: elapsed time against the budget and the last trial."""

    def __init__(self, budget_s: float, enabled: bool = True, stream: TextIO | None = None, width: int = 24):
        self.budget_s, self.enabled, self.width = budget_s, enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()

    def update(self, elapsed_s: float, text: str) -> None:
        """Redraw the bar (on a terminal) or print one line (in a log)."""
        if not self.enabled:
            return
        filled = min(self.width, int(self.width * elapsed_s / max(self.budget_s, 1e-9)))
        line = f"concur tune [{'#' * filled}{'.' * (self.width - filled)}] {elapsed_s:4.1f}/{self.budget_s:.0f} s  {text}"
        self.stream.write(("\r\033[K" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def tune(measure: Callable[[Config], Measurement], *, max_streams: int = 8,
         schedulers: Sequence[str] = ("critical_path", "fork"), budget_s: float = 20.0, patience: int = 1,
         min_gain: float = 0.01, eager_utilization: float | None = None, eager: Measurement | None = None,
         cache: TunerCache | None = None, key: str | None = None, progress: bool | Progress = True,
         clock: Callable[[], float] = time.monotonic) -> TuneResult:
    """Return the fastest configuration found by ``measure`` within ``budget_s`` seconds.

    ``measure(config)`` times a configuration (it may raise: the trial is
    recorded as failed and counts as no gain). ``patience`` is how many
    stream counts in a row may fail to beat the best before the climb stops.
    ``eager_utilization`` (percent, from :class:`concur.observe.monitor.Monitor`)
    picks the lever; ``eager`` is the eager loop's step time, reported only.
    With ``cache`` and ``key`` a stored result is returned without measuring,
    and a new one is stored.
    """
    hit = cached_result(cache, key)
    if hit is not None:
        return hit
    if not schedulers:
        raise ValueError("tune needs at least one scheduler")
    bar = progress if isinstance(progress, Progress) else Progress(budget_s, enabled=bool(progress))
    start = clock()
    lever = lever_for(eager_utilization)
    trials: list[Trial] = []

    def run(config: Config) -> Measurement | None:
        t0 = clock()
        try:
            m, err = measure(config), None
        except Exception as exc:  # a failed configuration is a result, not the end of tuning
            m, err = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        trials.append(Trial(config, m, err, clock() - t0))
        bar.update(clock() - start, f"{config.label}: " + (f"{m.median_ms:.2f} ms" if m else "failed"))
        return m

    def affordable() -> bool:
        spent = clock() - start
        per_trial = spent / max(len(trials), 1)
        return spent + per_trial <= budget_s

    primary = schedulers[0]
    serial_cfg = Config(1, primary)
    baseline = run(serial_cfg)
    if baseline is None:
        bar.close()
        return _finish(TuneResult(serial_cfg, None, None, tuple(trials), "the serial graph failed: kept 1 stream",
                                  lever, eager_utilization, eager, key, seconds=clock() - start), cache, key)
    best_cfg, best = serial_cfg, baseline
    stopped, misses = f"tried up to {max_streams} streams", 0
    for k in range(2, max_streams + 1):
        if not affordable():
            stopped = f"time budget of {budget_s:.0f} s reached before {k} streams"
            break
        m = run(Config(k, primary))
        if m is not None and beats(m, best, min_gain=min_gain):
            best_cfg, best, misses = Config(k, primary), m, 0
        else:
            misses += 1
            if misses >= patience:
                stopped = f"{k} streams did not beat {best_cfg.streams} beyond noise"
                break
    # Other schedulers at the best count; if serial stayed best, at the count that came closest.
    measured = [t for t in trials if t.measurement is not None and t.config.streams > 1]
    k_alt = best_cfg.streams if best_cfg.streams > 1 else (
        min(measured, key=lambda t: t.measurement.median_ms).config.streams if measured else 2)
    for name in schedulers[1:]:
        if not affordable():
            stopped += f"; budget left no time for {name}"
            break
        cfg = Config(k_alt, name)
        m = run(cfg)
        if m is not None and beats(m, best, min_gain=min_gain):
            best_cfg, best = cfg, m
    if lever == "streams" and best_cfg.streams > 1 and affordable():
        # The eager GPU was already busy, so the graph may no longer pay for its memory: check.
        cfg = Config(best_cfg.streams, best_cfg.scheduler, cuda_graph=False)
        m = run(cfg)
        if m is not None and beats(m, best, min_gain=min_gain):
            best_cfg, best = cfg, m
    bar.close()
    return _finish(TuneResult(best_cfg, best, baseline, tuple(trials), stopped, lever, eager_utilization, eager,
                              key, seconds=clock() - start), cache, key)


def cached_result(cache: TunerCache | None, key: str | None) -> TuneResult | None:
    """Return the stored result for ``key`` marked ``from_cache``, or None."""
    stored = cache.get(key) if cache is not None and key is not None else None
    return None if stored is None else replace(TuneResult.from_dict(stored), from_cache=True, key=key)


def _finish(result: TuneResult, cache: TunerCache | None, key: str | None) -> TuneResult:
    if cache is not None and key is not None and result.baseline is not None:
        cache.put(key, result.to_dict())
    return result


# ---------------------------------------------------------------------------------------------------------
# torch-facing part: build a train_step per configuration and time it.

Timer = Callable[[Callable[[], object], int, int], "tuple[float, float]"]


def _repeats_for(step_s: float, target_s: float = 0.4) -> int:
    """Return how many steps to time: about ``target_s`` of them, at least 10, at most 50."""
    return max(10, min(50, int(target_s / max(step_s, 1e-6))))


def tune_train_step(model: Any, loss_fn: Callable, optimizer: Any, example_batch: tuple, *,
                    make_step: Callable[..., Any], schedulers: Sequence[str] = ("critical_path", "fork"),
                    max_streams: int = 8,
                    budget_s: float = 20.0, cache_dir: Any = None, use_cache: bool = True,
                    compile: bool = False, progress: bool = True, probe_utilization: bool = True,
                    timer: Timer | None = None, **train_step_kwargs: Any) -> TuneResult:
    """Return the measured best configuration of ``concur.train_step`` for this model and batch.

    Every trial trains a deep copy of ``model`` and ``optimizer`` (copied
    together, so the copy's optimizer holds the copy's parameters): the
    caller's model, optimizer state and RNG state are left as they were.
    Without CUDA there is nothing to time; it returns 1 stream unmeasured
    unless a ``timer`` is given (tests). ``timer(fn, warmup, repeats)``
    returns (median_ms, iqr_ms); the default is CUDA events. ``make_step`` builds
    each trial's step with :func:`concur.train_step`'s signature (pass
    ``concur.train_step``): the tuner measures steps, it does not define them,
    so it does not import the training runtime that calls it.
    """
    import torch

    from concur.dag.annotate import cuda_device_in
    from concur.fx.plan import device_name

    inputs, targets = example_batch
    device = device_name(model, inputs if isinstance(inputs, tuple) else (inputs,))
    on_cuda = device != "cpu" and torch.cuda.is_available()
    if not on_cuda and timer is None:
        return TuneResult(Config(1, schedulers[0]), None, None, stopped="no CUDA device: nothing to time "
                          "(on CPU the plan runs in issue order, so the stream count does not matter)")
    if timer is None:
        from concur.observe.timing import time_cuda_ms as timer
    if compile:
        train_step_kwargs["compile"] = True
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    key = cache_key(model, example_batch, device, torch.__version__,
                    extra=(type(optimizer).__name__, type(loss_fn).__name__, tuple(schedulers), max_streams,
                           compile, sorted(train_step_kwargs.items())))
    cache = TunerCache(cache_dir) if use_cache else None
    hit = cached_result(cache, key)
    if hit is not None:
        return hit

    def build(config: Config) -> tuple[Any, list[str]]:
        m, opt = copy.deepcopy((model, optimizer))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = make_step(m, loss_fn, opt, example_batch, streams=config.streams,
                             cuda_graph=config.cuda_graph, scheduler=config.scheduler, **train_step_kwargs)
            step(inputs, targets)  # captures the graph
            sync()
        notes = list(dict.fromkeys(str(w.message).splitlines()[0][:200] for w in caught))
        status = getattr(step, "status", None)  # how the step runs: captured or eager, streams, why
        if status is not None:
            notes.insert(0, f"runs {status}")
            if on_cuda and config.cuda_graph and not status.captured:
                raise RuntimeError(f"train_step fell back to eager instead of {config.streams} streams: {status.why}")
        graphs = getattr(step, "graphs", None)
        if on_cuda and config.cuda_graph and isinstance(graphs, dict):
            got = [getattr(g, "streams", config.streams) for g in graphs.values()]
            if not got or got[0] != config.streams:
                raise RuntimeError(f"train_step fell back to {got[0] if got else 'eager'} instead of "
                                   f"{config.streams} streams: {'; '.join(notes)}")
        return step, notes

    def measure(config: Config) -> Measurement:
        step, notes = build(config)
        try:
            def fn() -> None:
                step(inputs, targets)

            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            sync()
            repeats = _repeats_for((time.perf_counter() - t0) / 3)
            median, iqr = timer(fn, 3, repeats)
            return Measurement(median, iqr, repeats, tuple(notes))
        finally:
            step = None  # drops the last reference (fn's cell included): its graphs go before the next capture
            if on_cuda:  # the captured graph's private memory pool goes back before the next capture
                gc.collect()
                torch.cuda.empty_cache()

    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if on_cuda else None)
    start = time.monotonic()
    try:
        eager_util, eager, notes = None, None, ()
        if probe_utilization and on_cuda:
            cuda = cuda_device_in(example_batch) or torch.device("cuda")
            try:
                eager_util, eager, notes = _probe_eager(build, timer, sync, inputs, targets,
                                                        min(1.5, 0.1 * budget_s), schedulers[0], cuda.index or 0)
            except Exception as exc:  # without the probe the lever is unknown; the search still runs
                notes = (f"eager utilization probe failed: {type(exc).__name__}: {str(exc)[:200]}",)
            gc.collect()
            torch.cuda.empty_cache()
        result = tune(measure, max_streams=max_streams, schedulers=schedulers,
                      budget_s=budget_s - (time.monotonic() - start), eager_utilization=eager_util, eager=eager,
                      cache=cache, key=key, progress=progress)
        # Report the whole time, probe included: that is what the caller waited.
        return replace(result, seconds=time.monotonic() - start, notes=result.notes + notes)
    finally:
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])


def _probe_eager(build: Callable, timer: Timer, sync: Callable, inputs: Any, targets: Any, seconds: float,
                 scheduler: str, cuda_index: int) -> tuple[float | None, Measurement | None, tuple[str, ...]]:
    """Run the eager serial step for ``seconds`` under the NVML monitor; return (utilization %, time, notes).

    NVML's utilization is the whole device's: where other processes had work
    on the GPU during the probe, it says nothing of this loop, so it is
    dropped (the lever is then unknown) and a note says why.
    """
    from concur.dag.nvml import nvml_index, other_processes_on
    from concur.observe.monitor import Monitor

    step, notes = build(Config(1, scheduler, cuda_graph=False))
    fn = lambda: step(inputs, targets)  # noqa: E731
    with Monitor(nvml_index(cuda_index)) as mon:
        mon.mark("eager")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            fn()
        sync()
    median, iqr = timer(fn, 2, 10)
    # The driver's first sample also covers time before the loop started: skip it where later ones exist.
    util = mon.record.mean_utilization(start_s=0.25)
    util = util if util is not None else mon.record.mean_utilization()
    others = other_processes_on(cuda_index)
    if others and util is not None:
        return None, Measurement(median, iqr, 10, tuple(notes)), (
            f"eager utilization not used: {others} other process{'es' if others > 1 else ''} had work on GPU "
            f"{cuda_index} (NVML's utilization is the whole device's), so the lever is unknown",)
    return util, Measurement(median, iqr, 10, tuple(notes)), ()

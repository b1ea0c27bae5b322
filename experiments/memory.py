"""Memory under pressure: does concur's step run where PyTorch's recipe just fits, and how fast.

    PYTHONPATH=. python -m experiments.memory --out DIR [--jobs 4]
    PYTHONPATH=. python -m experiments.memory --out DIR --networks googlenet --batches 64 --paths fused --streams auto
    PYTHONPATH=. python -m experiments.memory --out DIR --batches 64 --jobs 1 --without-streams1   (speeds, alone)
    PYTHONPATH=. python -m experiments.memory --out DIR --paths unfused --limit 20 --trial one-at-a-time side-by-side
    PYTHONPATH=. python -m experiments.memory --out DIR --paths unfused --without-streams1 --lean-pools
    PYTHONPATH=. python -m experiments.memory --out DIR --paths unfused --without-streams1 --training-memory

For each network x batch x path, PyTorch's whole-step CUDA-graph recipe
(experiments/peers.py: ``compile_graph_step`` on the fused path,
``eager_graph_step`` on the unfused one) first runs alone: its peak reserved
memory R, setup included, is the yardstick. Then, each under a process limit
of ``--limit`` x R (default 1.05): the recipe again (it must fit under its own
limit), concur's defaults (``train_step(..., amp_dtype=torch.bfloat16,
compile=path == "fused")``, 4 streams) and concur with ``streams=1``;
``--streams auto`` adds rows with ``streams="auto"``; ``--trial one-at-a-time
side-by-side`` adds the defaults with an unfused step's first calls timing
its programs side by side (``concur_side_by_side``); ``--lean-pools`` adds
the unfused defaults with every multi-stream plan saving no max-pooling
indices from the start (``concur_lean_pools``,
``concur.training.rungs.LEAN_POOLS_FIRST``; by default only the plans after
a capture that ran out of memory do); ``--training-memory`` adds the unfused
defaults with plans made for training's memory (``concur_training_memory``,
``concur.training.rungs.MEMORY_MODEL_FIRST``); ``CONCUR_PROBE_CALLER_OUTPUTS``
in the environment runs every concur child with the probe of
``experiments/caller_outputs.py`` (its rows' ``caller_outputs``). A run's outcome is
``fit`` (set up and trained its steps), ``fallback`` (it ran, but concur
warned that it dropped streams or ran eagerly; the warnings are in the row)
or ``error`` (the exception's type and first line, e.g. OutOfMemoryError;
``skipped`` where the recipe alone gave no R to limit by). DIR/memory.jsonl
gets one row per run, appended as each ends; a table of the outcomes, streams
kept, ms per step and peaks relative to the recipe's alone, and a count of
OutOfMemoryErrors, are printed at the end.

Method. Every run is a fresh process (``python -m experiments.memory
--child JSON``): the caching allocator's peaks and the memory limit are per
process. The recipe's processes load nothing of concur (each row records
whether concur was loaded), so the yardstick cannot depend on what it
measures; each concur process gets an empty decision cache of its own
(``CONCUR_CACHE_DIR``), so that it decides as a first run does, timing its
programs in setup, not reading an earlier run's decisions. The limit is
``torch.cuda.set_per_process_memory_fraction`` of the device's total memory,
set before anything is allocated; the allocator keeps reserved memory under
it, freeing its cached blocks before it raises OutOfMemoryError. A run builds
the model (``experiments/sweep_models.py``'s ``cuda_setup``: seeded, channels-last, SGD
with momentum 0.9, cross-entropy; forward and loss under bf16 autocast) and
its step, sets the step up (calls it once; an unfused concur step keeps being
called while ``step.deciding``, those calls timing its programs; then one call
more, which captures the program kept where a trial ended, and again while
that call started another trial: a narrower rung's, where the kept program's
capture did not fit) and trains
``--steps`` steps. Peak allocated and reserved count from the process's
start, setup included; the steady peaks from after setup (peak statistics
reset), i.e. what the step holds plus what a step adds. The ms per step come
from CUDA events over ``--timed-steps`` further steps. With ``--jobs N`` up to
N configurations run side by side, the runs of each one after another; limits
and peaks stay per process, but the processes share the GPU, so the times of
such a run are not speed figures: time with ``--jobs 1``. A concur row also
has what the step held by pool and stream at each failed setup attempt
(``held_at_failures``), and a compiled step's row the most streams its
forward and its backward graphs run (``forward_streams``,
``backward_streams``: under pressure the backward runs fewer). Every row has
how many allocations ran out of memory in setup (``setup_out_of_memory``,
the allocator's count: those raised and those an operation recovered from,
as cuDNN does by keeping a convolution algorithm with a smaller workspace
for the rest of the process); ``--oom-trace`` adds where each came from
(``oom_trace``: the setup call, the size, the innermost frames);
``--unsplit-weight-grads`` runs every concur side with each layer's weight
gradient on the layer's own stream (``split_weight_grads=False``);
``--serial-weight-grads`` runs every concur side with its one-stream plans
splitting weight gradients too (``concur.fx.plan.SERIAL_WEIGHT_GRADS``: the
model's own forward, the weight gradients on their stream);
``--without-caller-memory`` runs every concur side without the rung that
tries an unfused program that ran out of memory again with its side streams'
memory and its backward the caller's stream's
(``concur.training.rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY`` off). ``--kernels N``
profiles a few steps more and records each side's N CUDA kernels that take
the most time per step: where two sides of one configuration differ in
speed, which kernels differ (a convolution whose algorithm was chosen while
memory was short, say), and its 3N host functions with the most time per step
under cProfile and the dispatch modes left on torch's stack (``host_profile``:
where a step's time is the host's). The processes' limits together may exceed the GPU's
memory with several jobs at large batches; a run the driver cannot serve then
fails although it fits its limit.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from experiments import peers
from experiments.memory_records import (MB, PROFILED_STEPS, CallLog, breakdown, out_of_memory_count, profile_host,
                                        profile_kernels, trace_out_of_memory)
from experiments.sweep_models import cuda_setup as setup

REPO = Path(__file__).resolve().parents[1]
NETWORKS = ("googlenet", "inception_v3", "resnet50", "hrnet_w18_small")
BATCHES = (8, 64, 128)
PATHS = ("fused", "unfused")
RECIPE_OF_PATH = {"fused": "compile_graph", "unfused": "eager_graph"}
# how an unfused concur step times its programs on its first calls: one at a time (the default), or every
# program captured at once (concur.training.trial.SIDE_BY_SIDE on)
TRIALS = ("one-at-a-time", "side-by-side")
ROW_MARK = "MEMORY_ROW "  # the child's row among whatever else torch prints to stdout
MAX_SETUP_CALLS = 60  # an unfused concur step decides in 16 calls or more; past this it is measured as it stands
CHILD_TIMEOUT_S = 3600.0
PROBE_ENV = "CONCUR_PROBE_CALLER_OUTPUTS"  # experiments/caller_outputs.py's switch, imported by concur children only
# the switches that apply to every concur child of a run (--unsplit-weight-grads ...): payloads and rows carry each
SWITCHES = ("unsplit_weight_grads", "serial_weight_grads", "without_caller_memory")
FALLBACK = re.compile(r"fall(s|ing)? back|runs? eagerly|eager execution|on one stream, because|on 1 stream instead",
                      re.IGNORECASE)


@dataclass(frozen=True)
class Config:
    """One point of the benchmark: a network, a batch size and a path (fused: torch.compile; unfused: plain ops)."""

    network: str
    batch: int
    path: str


@dataclass(frozen=True)
class Side:
    """One run under the limit: who runs (``recipe`` or ``concur``), the ``streams`` passed (None: the default),
    how a concur step times its programs on its first calls (``trial``, one of :data:`TRIALS`) and whether its
    first plans save no max-pooling indices (``lean_pools``) and the memory model its plans are made with
    (``memory_model``, :data:`concur.training.rungs.MEMORY_MODEL_FIRST`)."""

    name: str
    who: str
    streams: int | str | None = None
    trial: str = TRIALS[0]
    lean_pools: bool = False
    memory_model: str = "forward"


RECIPE_ALONE = Side("recipe_alone", "recipe")


def limited_sides(extra_streams: list[str], without_streams1: bool = False,
                  trials: Iterable[str] = TRIALS[:1], lean_pools: bool = False,
                  training_memory: bool = False) -> list[Side]:
    """The runs under the limit: the recipe, concur's defaults, concur on one stream (unless ``without_streams1``:
    a run that times the defaults alone saves a compile), then each extra stream count, then concur's defaults
    again for each trial after the first (``concur_side_by_side``): the first trial is every concur run's; then,
    with ``lean_pools``, the defaults with their first plans saving no max-pooling indices; with
    ``training_memory``, the defaults with plans made for training's memory (``concur_training_memory``)."""
    first, *others = dict.fromkeys(trials)
    sides = [Side("recipe", "recipe"), Side("concur", "concur", trial=first)]
    if not without_streams1:
        sides.append(Side("concur_streams1", "concur", 1, first))
    for s in extra_streams:
        if f"concur_streams{s}" not in {side.name for side in sides}:
            sides.append(Side(f"concur_streams{s}", "concur", s if s == "auto" else int(s), first))
    sides += [Side(f"concur_{trial.replace('-', '_')}", "concur", trial=trial) for trial in others]
    if lean_pools:
        sides.append(Side("concur_lean_pools", "concur", trial=first, lean_pools=True))
    if training_memory:
        sides.append(Side("concur_training_memory", "concur", trial=first, memory_model="training"))
    return sides


def memory_fraction(limit_bytes: float, total_bytes: int) -> float:
    """Return the fraction of the device's memory that ``limit_bytes`` is (at most 1: torch refuses more)."""
    return min(1.0, limit_bytes / total_bytes)


# --- the child: one run in its own process ------------------------------------------------------
# The CUDA calls sit in these small functions so that a CPU test can stand in for them.

def _device() -> tuple[str, int]:
    """(name, total bytes): the total as the allocator sees it, the one a memory fraction multiplies."""
    if not torch.cuda.is_available():
        raise RuntimeError("experiments.memory needs a CUDA device: the recipes capture CUDA graphs")
    return torch.cuda.get_device_name(), torch.cuda.mem_get_info()[1]


def _set_limit(fraction: float) -> None:
    torch.cuda.set_per_process_memory_fraction(fraction)


def _peaks() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _held() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _reset_peaks() -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def _ms_per_step(fn: Callable[[], Any], steps: int) -> float:
    """CUDA-event ms of one of ``steps`` back-to-back calls: concur.observe.timing's cuda_block_ms, written out
    because the recipe's processes must not load concur."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def _record_failures(row: dict) -> None:
    """Make each failed setup attempt of the concur step (trial, warm-up, capture) add :func:`breakdown` to
    ``row["held_at_failures"]`` before it gives its memory back: what the step held, by pool and stream, when it
    did not fit. The step's internals: this tool measures them, in a process of its own."""
    if not torch.cuda.is_available():  # no graphs, no runner: nothing to record
        return
    from concur.training import graph_runner

    give_back = graph_runner.CudaGraphRunner.failed

    def failed(self: Any) -> None:
        row.setdefault("held_at_failures", []).append(breakdown())
        give_back(self)

    graph_runner.CudaGraphRunner.failed = failed  # type: ignore[method-assign]


def _concur_step(model: torch.nn.Module, loss_fn: Callable, optimizer: Callable, batch: tuple, path: str,
                 streams: int | str | None, trial: str = TRIALS[0], lean_pools: bool = False,
                 memory_model: str = "forward", unsplit_weight_grads: bool = False,
                 serial_weight_grads: bool = False, without_caller_memory: bool = False) -> Any:
    import concur  # here only: the recipe's processes must not load it
    from concur.fx import plan
    from concur.training import rungs, trial as trial_policy

    trial_policy.SIDE_BY_SIDE = trial == "side-by-side"  # how an unfused step's first calls time its programs
    rungs.LEAN_POOLS_FIRST = lean_pools  # whether its first plans already save no max-pooling indices
    rungs.MEMORY_MODEL_FIRST = memory_model  # what its plans count of memory
    if without_caller_memory:  # no rung out of memory tried again with the caller's memory
        rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY = False
    if os.environ.get(PROBE_ENV):  # a probe (experiments/caller_outputs.py), over concur's caller memory
        from experiments import caller_outputs

        caller_outputs.install(caller_outputs.form_asked())
    chosen = {} if streams is None else {"streams": streams}  # None: concur's own default
    plan.SERIAL_WEIGHT_GRADS = serial_weight_grads  # whether its one-stream plans split weight gradients too
    if unsplit_weight_grads:
        chosen["split_weight_grads"] = False
    return concur.train_step(model, loss_fn, optimizer(model.parameters()), batch, amp_dtype=torch.bfloat16,
                             compile=path == "fused", **chosen)


def _plain(fields: dict) -> dict:
    """``fields`` with every value JSON can hold as it is, the others as a short repr (a module's would be pages)."""
    return {k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)[:300] for k, v in fields.items()}


def _streams_kept(step: Any) -> dict:
    """How the step runs (``TrainStep.status``: captured or eager, the streams of its program, why, what its
    captures went through) and the decisions it took."""
    found: dict[str, Any] = {}
    status = getattr(step, "status", None)
    if status is not None:
        found["status"] = str(status)
        found.update(mode=status.mode, streams=status.streams, why=status.why, captures=status.captures,
                     capture_failures=status.failures, recovered=status.recovered,
                     fallbacks=list(status.fallbacks))
    graphs = getattr(step, "graphs", None) or {}
    found["graph_streams"] = sorted({getattr(c, "streams", None) for c in graphs.values()}, key=str)
    # a compiled step's forward and backward graphs: under memory pressure its backward runs fewer streams
    compiled = [g for b in (getattr(step, "backends", None) or {}).values() for g in getattr(b, "graphs", ())]
    if compiled:
        for kind, backward in (("forward_streams", False), ("backward_streams", True)):
            found[kind] = max((g.num_streams for g in compiled if g.is_backward == backward), default=1)
    decisions = getattr(step, "step_decisions", None) or []
    found["decisions"] = [dict(keep=getattr(d, "keep", None), source=getattr(d, "source", None),
                               reason=str(getattr(d, "reason", ""))[:300]) for d in decisions]
    return found


def _is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` or what it wraps (inductor and concur re-raise) ran out of device memory."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _train(payload: dict, row: dict) -> None:
    """Set the limit, build the side's step, set it up, train and time it; the measurements go into ``row``."""
    gpu, total = _device()
    row.update(gpu=gpu, total_memory_mb=total / MB)
    if payload["limit_bytes"] is not None:
        fraction = memory_fraction(payload["limit_bytes"], total)
        _set_limit(fraction)  # before anything is allocated, so that setup runs under it too
        row.update(fraction=fraction, limit_mb=payload["limit_bytes"] / MB)
    model, batch, loss_fn, optimizer = setup(payload["network"], payload["batch"])
    if payload["who"] == "recipe":
        recipe = peers.RECIPES[RECIPE_OF_PATH[payload["path"]]]
        step = recipe(model, loss_fn, optimizer, batch, amp_dtype=torch.bfloat16)
    else:
        _record_failures(row)
        step = _concur_step(model, loss_fn, optimizer, batch, payload["path"], payload["streams"], payload["trial"],
                            payload["lean_pools"], payload["memory_model"],
                            **{s: bool(payload.get(s)) for s in SWITCHES})
    made = [0]  # setup calls made so far, read by the out-of-memory trace
    if payload.get("oom_trace"):
        trace_out_of_memory(row, made)
        if payload["who"] == "concur":
            step = CallLog(step, row.setdefault("call_log", []))
    step(*batch)
    made[0] = 1
    # An unfused concur step times its programs on its first calls: part of its setup, and of its peak. Where a
    # trial ended, the next call captures the program kept: setup too, not a steady step; should that capture not
    # fit, a narrower rung may start a trial of its own, which is setup as well. Setup ends with a call that
    # neither found nor left a trial running.
    while made[0] < MAX_SETUP_CALLS:
        deciding = getattr(step, "deciding", False)
        step(*batch)
        made[0] += 1
        if not deciding and not getattr(step, "deciding", False):
            break
    row["still_deciding"] = bool(getattr(step, "deciding", False))
    row["setup_calls"] = made[0]
    row["setup_out_of_memory"] = out_of_memory_count()
    setup_peaks = _peaks()
    held = _held()
    row["held_by_pool_and_stream"] = breakdown()
    _reset_peaks()
    losses, steady_ms = [], []
    for _ in range(payload["steps"]):  # each step's wall time, synced: a step that captured again stands out
        start = time.perf_counter()
        losses.append(step(*batch))
        if torch.cuda.is_available():  # the tests' children run on the CPU
            torch.cuda.synchronize()
        steady_ms.append(round((time.perf_counter() - start) * 1e3, 2))
    steady = _peaks()
    row["steady_ms"] = steady_ms
    row["losses"] = [float(loss) for loss in losses]  # the same batch each step: runs of one config compare
    row.update(setup_peak_allocated_mb=setup_peaks[0] / MB, setup_peak_reserved_mb=setup_peaks[1] / MB,
               held_allocated_mb=held[0] / MB, held_reserved_mb=held[1] / MB,
               steady_peak_allocated_mb=steady[0] / MB, steady_peak_reserved_mb=steady[1] / MB,
               peak_allocated_mb=max(setup_peaks[0], steady[0]) / MB,
               peak_reserved_mb=max(setup_peaks[1], steady[1]) / MB)
    if payload["who"] == "concur":
        row.update(_streams_kept(step))
        if os.environ.get(PROBE_ENV):
            from experiments import caller_outputs

            row["caller_outputs"] = dict(caller_outputs.COUNTS, form=caller_outputs.form_asked())
    row["ms_per_step"] = _ms_per_step(lambda: step(*batch), payload["timed_steps"])
    if payload["who"] == "concur" and getattr(step, "status", None) is not None:
        row["status_after_timing"] = str(step.status)  # captures made by the timed steps show here
    if payload["who"] == "concur" and payload.get("oom_trace"):
        from concur import streams as concur_streams  # the trace's streams told apart: made at first use

        row["weight_grad_stream_ids"] = [s.stream_id for s in concur_streams._WEIGHT_GRAD_STREAMS.values()]
    if payload.get("kernels"):
        row["top_kernels"] = profile_kernels(lambda: step(*batch), PROFILED_STEPS, payload["kernels"])
        row["host_profile"] = profile_host(lambda: step(*batch), PROFILED_STEPS, 3 * payload["kernels"])


def base_row(payload: dict) -> dict:
    """What every row of a run carries, whatever became of it: the configuration, the side, the versions, the date."""
    return dict(network=payload["network"], batch=payload["batch"], path=payload["path"], side=payload["side"],
                who=payload["who"], streams_requested=payload["streams"], limit=payload["limit"],
                trial=payload["trial"] if payload["who"] == "concur" else None,
                lean_pools=payload["lean_pools"] if payload["who"] == "concur" else None,
                memory_model=payload["memory_model"] if payload["who"] == "concur" else None,
                **{s: bool(payload.get(s)) if payload["who"] == "concur" else None for s in SWITCHES},
                recipe=RECIPE_OF_PATH[payload["path"]] if payload["who"] == "recipe" else None,
                torch=torch.__version__, date=datetime.date.today().isoformat())


def child(payload: dict) -> dict:
    """Run one side of one configuration in this process; return its row (an exception becomes an error row)."""
    row = base_row(payload)
    caught: list[warnings.WarningMessage] = []
    started = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # concur warns once per step; an earlier filter must not hide it
            _train(payload, row)
    except Exception as exc:  # noqa: BLE001 - every failure, OOM or not, is the row's outcome
        row.update(outcome="error", error_type=type(exc).__name__,
                   error=(str(exc).splitlines() or [""])[0][:500], oom=_is_oom(exc))
        try:  # how far it got before failing
            allocated, reserved = _peaks()
            row.setdefault("peak_allocated_mb", allocated / MB)
            row.setdefault("peak_reserved_mb", reserved / MB)
        except Exception:  # noqa: BLE001 - no CUDA, or a device left unusable by the failure
            pass
    texts = list(dict.fromkeys(str(w.message)[:1000] for w in caught))
    row["warnings"] = texts
    row["fallback_warnings"] = [t for t in texts if t.startswith("concur") and FALLBACK.search(t)]
    if "outcome" not in row:
        row.update(outcome="fallback" if row["fallback_warnings"] else "fit", oom=False)
    row["wall_s"] = time.perf_counter() - started
    row["concur_loaded"] = any(m == "concur" or m.startswith("concur.") for m in sys.modules)
    return row


# --- the parent: chains of children, rows, table ------------------------------------------------

def _launch(payload: dict, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Start ``python -m experiments.memory --child`` in the repository, whatever the current folder."""
    return subprocess.run([sys.executable, "-m", "experiments.memory", "--child", json.dumps(payload)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout_s)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_child(payload: dict, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
    """Run one side in a child process; return its row, or an error row where it crashed, hung or printed none."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cache = None
    if payload["who"] == "concur":
        cache = tempfile.mkdtemp(prefix="concur_decisions_")
        env["CONCUR_CACHE_DIR"] = cache
    try:
        proc = _launch(payload, env, timeout_s)
    except subprocess.TimeoutExpired:
        return _failed_row(payload, "Timeout", f"no row after {timeout_s:.0f} s", "")
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    rows = [line[len(ROW_MARK):] for line in (proc.stdout or "").splitlines() if line.startswith(ROW_MARK)]
    try:
        row = json.loads(rows[-1]) if rows else None
    except json.JSONDecodeError:  # cut off by a kill while printing
        row = None
    if row is None:
        return _failed_row(payload, "ChildCrashed", _exit_reason(proc.returncode), proc.stderr or "")
    row["exit_code"] = proc.returncode  # a crash on the way out, after the row, leaves the row standing
    return row


def _failed_row(payload: dict, error_type: str, error: str, stderr: str) -> dict:
    return dict(base_row(payload), outcome="error", error_type=error_type, error=error, stderr_tail=stderr[-2000:],
                oom="out of memory" in stderr.lower())


def _payload(config: Config, side: Side, args: argparse.Namespace, limit_bytes: float | None) -> dict:
    return dict(network=config.network, batch=config.batch, path=config.path, side=side.name, who=side.who,
                streams=side.streams, limit=args.limit if limit_bytes is not None else None,
                limit_bytes=limit_bytes, steps=args.steps, timed_steps=args.timed_steps, kernels=args.kernels,
                trial=side.trial, lean_pools=side.lean_pools, memory_model=side.memory_model,
                oom_trace=getattr(args, "oom_trace", False), **{s: getattr(args, s, False) for s in SWITCHES})


def run_config(config: Config, args: argparse.Namespace, emit: Callable[[dict], None]) -> list[dict]:
    """The recipe alone, then each side under ``args.limit`` times its peak reserved; every row goes to ``emit``."""
    alone = run_child(_payload(config, RECIPE_ALONE, args, None), args.timeout)
    emit(alone)
    rows = [alone]
    reserved = alone.get("peak_reserved_mb") if alone["outcome"] != "error" else None
    for side in limited_sides(args.streams, args.without_streams1, args.trial, args.lean_pools,
                              args.training_memory):
        if reserved is None:
            row = dict(base_row(_payload(config, side, args, None)), outcome="skipped", oom=False,
                       error=f"the recipe alone gave no peak to limit by ({alone.get('error_type')})")
        else:
            row = run_child(_payload(config, side, args, args.limit * reserved * MB), args.timeout)
        emit(row)
        rows.append(row)
    return rows


def configs(args: argparse.Namespace) -> list[Config]:
    return [Config(n, b, p) for n in args.networks for b in args.batches for p in args.paths]


def run(args: argparse.Namespace) -> list[dict]:
    """Run every configuration, ``args.jobs`` side by side, appending rows to ``args.out/memory.jsonl``."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "memory.jsonl"
    lock = threading.Lock()

    def emit(row: dict) -> None:
        with lock:
            with path.open("a") as f:
                f.write(json.dumps(row, default=repr) + "\n")
            print(f"{row['network']} b{row['batch']} {row['path']} {row['side']}: {_cell(row, None)}", flush=True)

    points = configs(args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        chains = list(pool.map(lambda c: run_config(c, args, emit), points))
    return [row for chain in chains for row in chain]


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def _cell(row: dict, alone: dict | None) -> str:
    """One run in the table: outcome, streams kept, ms per step, peak allocated / reserved over the recipe's alone."""
    if row["outcome"] == "skipped":
        return "skipped"
    if row["outcome"] == "error":
        return "OOM" if row.get("oom") else f"error: {row.get('error_type')}"
    streams = row.get("streams")
    parts = [row["outcome"]]
    if streams is not None:
        parts.append(f"s{'/'.join(map(str, streams)) if isinstance(streams, list) else streams}")
    if row.get("backward_streams") not in (None, row.get("forward_streams")):
        parts.append(f"(backward {row['backward_streams']})")
    if row.get("ms_per_step") is not None:
        parts.append(f"{row['ms_per_step']:.2f} ms")
    if alone is not None:
        parts.append(f"{_ratio(row.get('peak_allocated_mb'), alone.get('peak_allocated_mb'))}"
                     f"/{_ratio(row.get('peak_reserved_mb'), alone.get('peak_reserved_mb'))}")
    return " ".join(parts)


def table(rows: list[dict]) -> list[str]:
    """A markdown table, one line per configuration in the order the rows came, and the OutOfMemoryError count."""
    by_config: dict[tuple, dict[str, dict]] = {}
    sides: list[str] = []
    for row in rows:
        by_config.setdefault((row["network"], row["batch"], row["path"]), {})[row["side"]] = row
        if row["side"] != RECIPE_ALONE.name and row["side"] not in sides:
            sides.append(row["side"])
    lines = ["| network | batch | path | recipe alone: peak reserved MB | "
             + " | ".join(sides) + " |", "|---|---|---|---|" + "---|" * len(sides)]
    for (network, batch, path), runs in by_config.items():
        alone = runs.get(RECIPE_ALONE.name)
        base = (f"{alone['peak_reserved_mb']:.0f}" if alone and alone.get("peak_reserved_mb") is not None
                and alone["outcome"] != "error" else _cell(alone, None) if alone else "-")
        cells = [_cell(runs[s], alone) if s in runs else "-" for s in sides]
        lines.append(f"| {network} | {batch} | {path} | {base} | " + " | ".join(cells) + " |")
    lines.append("Cells: outcome, streams kept, ms per step, peak allocated / reserved over the recipe's alone "
                 "(setup included).")
    lines.append(oom_line(rows))
    return lines


def oom_line(rows: list[dict]) -> str:
    """The count of runs that ran out of memory, in all and by side."""
    ran = [r for r in rows if r["outcome"] != "skipped"]
    by_side: dict[str, list[int]] = {}
    for r in ran:
        counts = by_side.setdefault(r["side"], [0, 0])
        counts[0] += bool(r.get("oom"))
        counts[1] += 1
    return (f"OutOfMemoryError in {sum(c[0] for c in by_side.values())} of {len(ran)} runs: "
            + ", ".join(f"{side} {n}/{total}" for side, (n, total) in by_side.items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the folder of memory.jsonl")
    ap.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=NETWORKS)
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--limit", type=float, default=1.05, help="each side's limit, times the recipe's peak reserved")
    ap.add_argument("--steps", type=int, default=10, help="steps after setup, for the peaks")
    ap.add_argument("--timed-steps", type=int, default=20, help="steps timed with CUDA events, after those")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="record each side's N most time-consuming CUDA kernels and 3N host functions (profiled steps "
                         "after the timed ones)")
    ap.add_argument("--streams", nargs="*", default=[], help="more concur rows with these streams (e.g. auto 2)")
    ap.add_argument("--without-streams1", action="store_true",
                    help="no streams=1 row (timing the defaults alone under the limit: one compile fewer per config)")
    ap.add_argument("--trial", nargs="+", choices=TRIALS, default=list(TRIALS[:1]),
                    help="how an unfused concur step times its programs on its first calls (concur.training.trial); "
                         "a second value adds a run of the defaults timed that way (concur_side_by_side)")
    ap.add_argument("--lean-pools", action="store_true",
                    help="a run of the defaults whose first plans save no max-pooling indices (concur_lean_pools)")
    ap.add_argument("--training-memory", action="store_true",
                    help="a run of the defaults whose plans are made for training's memory (concur_training_memory)")
    ap.add_argument("--unsplit-weight-grads", action="store_true",
                    help="every concur run with split_weight_grads=False (each layer's weight gradient on its stream)")
    ap.add_argument("--serial-weight-grads", action="store_true",
                    help="every concur run's one-stream plans split weight gradients too (concur.fx.plan."
                         "SERIAL_WEIGHT_GRADS): a serial forward, the weight gradients on their own stream")
    ap.add_argument("--without-caller-memory", action="store_true",
                    help="no concur run tries a rung out of memory again with the caller's memory before fewer "
                         "streams (concur.training.rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY off)")
    ap.add_argument("--oom-trace", action="store_true",
                    help="record where each allocation that ran out of memory came from (rows' oom_trace), and "
                         "each concur call that changed its captures (rows' call_log)")
    ap.add_argument("--jobs", type=int, default=1, help="configurations side by side (times are then not speeds)")
    ap.add_argument("--timeout", type=float, default=CHILD_TIMEOUT_S, help="seconds for one child")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for s in args.streams:
        if s != "auto" and not s.isdigit():
            ap.error(f"--streams takes counts or 'auto', got {s!r}")
    if args.child is None and args.out is None:
        ap.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        print(ROW_MARK + json.dumps(child(json.loads(args.child)), default=repr), flush=True)
        return
    rows = run(args)
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()

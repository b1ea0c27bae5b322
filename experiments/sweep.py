"""Sweep models x batch sizes x precisions x modes; one subprocess per configuration, resumable.

    python -m experiments.sweep                                   # everything, on the GPU
    python -m experiments.sweep --models googlenet branchy:8x64 --batches 8 64 --precisions bf16
    python -m experiments.sweep --out experiments/results/2026-12-01-h100 --resume
    python -m experiments.sweep --cpu-smoke --out /tmp/smoke       # tiny nets on CPU: plumbing only
    python -m experiments.sweep --models googlenet --modes compile_graph fused:4 \
        --together compile_graph,fused:4 --compile-jobs 6          # the two timed in turns, one child

Modes (``:K`` is a stream count, ``auto`` lets ``train_step`` choose):

    eager               the plain loop (zero_grad, forward under autocast, backward, step)
    eager_streams:K     concur's plan on K streams without a graph (train_step, cuda_graph=False)
    serial_graph        whole-step CUDA graph, one stream (train_step streams=1)
    concur_graph:K      whole-step CUDA graph with K streams; concur_graph:auto uses streams="auto"
    compile             torch.compile(model) in the plain loop
    compile_graph       torch.compile + whole-step CUDA graph (train_step streams=1, compile=True)
    reduce_overhead     torch.compile(model, mode="reduce-overhead") in the plain loop, with
                        torch.compiler.cudagraph_mark_step_begin() before each step
    fused:K             concur's torch.compile backend on K streams + whole-step graph
                        (inductor's kernels placed on streams after fusion; rows before
                        2026-11-23 17:00 UTC cut each graph into segments, see compiled_graphs)
    fused_fresh:K       fused with buffer_reuse=False: inductor gives every buffer its own memory,
                        so no reuse chains independent branches (measured on the H100 2026-11-23:
                        never slower than fused; not yet concur's default)
    critical_path       not a step time: profiles the forward op by op and reports the
                        longest dependency path of the measured kernel times (the bound)

Every compiling configuration runs in its own ``python -m experiments.sweep --one '<json>'``;
the other modes of one model, batch and precision share one child
(``--group``), which saves an interpreter start, a CUDA context and a model
build per mode. A crash, an OOM or a hang (``--timeout-per-config``) is
recorded against the configuration it hit, the rest of its group runs again
one per child, and the sweep goes on; a mode that raises is a result too. Results are appended to
``results.jsonl`` as they come; ``--resume`` skips configurations already there.

``--together serial_graph,concur_graph:4`` sets up those modes of each model,
batch and precision in one child and times them in alternating rounds, so
that the ratio of two modes does not depend on the minute each was timed in.
``--compile-jobs N`` runs N children at once, in waves that keep their memory
apart: they compile and capture side by side and take turns to time, each
alone on the GPU (a file lock).
At the end ``results.json``, ``results.csv``, ``summary.md`` and PNG plots are
written; each names the date, GPU, driver and torch version.
Modes needing CUDA are recorded as "skipped: no CUDA" on a machine without one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import datetime
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
ALL_MODES = ("eager", "eager_streams:4", "serial_graph", "concur_graph:2", "concur_graph:4", "concur_graph:auto",
             "compile", "compile_graph", "reduce_overhead", "fused:4", "critical_path")
FUSED_MODES = ("fused", "fused_fresh")
CUDA_MODES = ("serial_graph", "concur_graph", "compile_graph", "reduce_overhead", *FUSED_MODES, "critical_path")
CONCUR_MODES = ("eager_streams", "concur_graph", *FUSED_MODES)  # the rest: what a user has
COMPILING_MODES = ("compile", "compile_graph", "reduce_overhead", *FUSED_MODES)  # a child each
FUSED_OPTIONS = {"fused": None, "fused_fresh": {"buffer_reuse": False}}
PRECISIONS = ("fp32", "bf16", "fp32-cl")  # bf16 = autocast + channels-last; fp32-cl = fp32, channels-last
CHANNELS_LAST_PRECISIONS = ("bf16", "fp32-cl")
DEFAULT_BATCHES = [8, 32, 64, 128]
SMOKE = dict(models=["branchy:2x8", "nascell:8"], batches=[2], precisions=["fp32"],
             modes=["eager", "eager_streams:2", "serial_graph", "critical_path"], image_size=32, repeats=3)
NODE_RANGE = "concur_node::"  # record_function prefix naming a plan node in a profiler trace


def config_key(cfg: dict) -> str:
    """Return the identity of a configuration in results.jsonl (what --resume matches)."""
    return f"{cfg['model']}|{cfg['batch']}|{cfg['precision']}|{cfg['mode']}"


META_FIELDS = ("date", "gpu", "driver", "torch", "cuda", "concur")


def meta_of_rows(rows: list[dict], fallback: dict) -> dict:
    """The run's date, GPU, driver and versions as its rows recorded them (a resumed run may mix them)."""
    meta = {}
    for k in META_FIELDS:
        values = sorted({str(r[k]) for r in rows if r.get(k) is not None})
        meta[k] = " + ".join(values) if values else fallback.get(k)
    return meta


def run_meta() -> dict:
    """Return date, GPU, driver, torch and CUDA versions: the fields every result file carries."""
    import torch

    import concur
    from concur.observe.monitor import driver_version

    cuda = torch.cuda.is_available()
    return dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name() if cuda else "cpu",
                driver=driver_version(), torch=torch.__version__, cuda=torch.version.cuda,
                concur=concur.__version__)


# --------------------------------------------------------------------------- critical-path bound


@dataclass(frozen=True)
class CriticalPathBound:
    """Forward-pass DAG with measured kernel times: their sum, the longest path, and coverage."""

    serial_us: float
    critical_path_us: float
    nodes_measured: int
    nodes_total: int

    @property
    def bound_speedup(self) -> float:
        """Serial time over the critical path: no number of streams runs the forward faster."""
        return self.serial_us / self.critical_path_us if self.critical_path_us > 0 else 1.0


def node_times_from_trace(events: list[dict]) -> tuple[dict[str, float], set[str]]:
    """Return (mean GPU µs per plan node per run, nodes seen) from Chrome-trace events.

    A kernel belongs to the node whose ``concur_node::<name>`` CPU range holds
    the runtime call that launched it (linked by ``correlation``), so kernels
    that run later, asynchronously, are still charged to the right node.
    """
    from concur.observe.profile_trace import GPU_CATEGORIES, LAUNCH_CATEGORIES

    ranges, launches, kernels = [], {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if name.startswith(NODE_RANGE) and cat != "gpu_user_annotation":
            ranges.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), name[len(NODE_RANGE):]))
        elif cat in LAUNCH_CATEGORIES and (e.get("args") or {}).get("correlation") is not None:
            launches[e["args"]["correlation"]] = float(e["ts"])
        elif cat in GPU_CATEGORIES:
            kernels.append(e)
    ranges.sort()
    runs: dict[str, int] = {}
    for _, _, name in ranges:
        runs[name] = runs.get(name, 0) + 1
    total: dict[str, float] = {}
    for k in kernels:
        ts = launches.get((k.get("args") or {}).get("correlation"))
        if ts is None:
            continue
        # Innermost range holding the launch: the one that started last before it.
        owner = next((n for s, e, n in reversed(ranges) if s <= ts <= e), None)
        if owner is not None:
            total[owner] = total.get(owner, 0.0) + float(k.get("dur", 0))
    return {n: total.get(n, 0.0) / runs[n] for n in runs}, set(runs)


def critical_path_bound(trace_path: str | os.PathLike, plan: Any) -> CriticalPathBound:
    """Return the critical-path bound of ``plan.dag`` with node costs measured in a profiler trace.

    The trace must hold ``concur_node::<node>`` ranges (see :func:`profile_plan_nodes`).
    Nodes that launched no kernel cost 0; nodes absent from the trace keep no
    cost either and are counted out of ``nodes_measured``.
    """
    from concur.observe.profile_trace import load_events
    from schedulers.analysis import critical_path_length

    times, seen = node_times_from_trace(load_events(trace_path))
    dag = plan.dag.copy()
    for name, data in dag.nodes(data=True):
        data["cost"] = times.get(name, 0.0)
    return CriticalPathBound(serial_us=sum(times.get(n, 0.0) for n in dag.nodes),
                             critical_path_us=critical_path_length(dag),
                             nodes_measured=len(seen & set(dag.nodes)), nodes_total=dag.number_of_nodes())


def profile_plan_nodes(plan: Any, inputs: tuple, path: Path, amp_dtype: Any, runs: int = 3) -> Path:
    """Run the plan's traced forward op by op, each node in a ``concur_node::`` range; write a trace.

    Serially, on one stream: the point is each node's own kernel time, free of
    contention, which is what the bound assumes.
    """
    import torch
    import torch.fx as fx
    from torch.profiler import ProfilerActivity, profile, record_function

    class Named(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            with record_function(NODE_RANGE + n.name):
                return super().run_node(n)

    interp = Named(plan.traced)

    def forward() -> None:
        with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            interp.run(*inputs)

    forward()  # warm-up: cuDNN autotuning and lazy init stay out of the trace
    torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            forward()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path


# --------------------------------------------------------------------------- one configuration (child)


def _file_stem(key: str) -> str:
    return key.replace("|", "_").replace(":", "-")


def _streams_arg(mode: str) -> int | str:
    k = mode.split(":", 1)[1] if ":" in mode else "1"
    return "auto" if k == "auto" else int(k)


@dataclass
class PreparedMode:
    """One mode of one configuration, set up (compiled or captured) and ready to step."""

    row: dict
    step_fn: Callable[[], None]
    train_step: Any  # concur's TrainStep, or None for the plain-loop modes
    model: Any
    x: Any
    cuda: bool


def _start_row(cfg: dict) -> dict:
    """The row of a configuration, before anything ran."""
    row = dict(cfg, key=config_key(cfg), started=time.time(), status="ok", peak_mb=None)
    row.pop("fail", None)
    return row


def _check_runnable(cfg: dict, cuda: bool) -> str | None:
    """Return the final status of a configuration that does not run here, after injected failures."""
    if cfg["mode"].split(":")[0] in CUDA_MODES and not cuda:
        return "skipped: no CUDA"
    if cfg.get("fail") == "raise":
        raise RuntimeError("forced failure (--inject-failure)")
    if cfg.get("fail") == "crash":
        os.abort()  # as a segfault or the OOM killer would: no row from the child at all
    return None


def _model_and_batch(cfg: dict, device: str) -> tuple[Any, Any, Any, Any]:
    """The seeded model in the configuration's layout, one batch, and the bf16 autocast dtype (or None)."""
    import torch

    from experiments.sweep_models import build

    torch.manual_seed(0)
    model, size = build(cfg["model"])
    size = cfg.get("image_size") or size
    layout = torch.channels_last if cfg["precision"] in CHANNELS_LAST_PRECISIONS else torch.contiguous_format
    model = model.to(device).train().to(memory_format=layout)
    x = torch.randn(cfg["batch"], 3, size, size, device=device).to(memory_format=layout)
    y = torch.randint(0, 1000, (cfg["batch"],), device=device)
    return model, x, y, torch.bfloat16 if cfg["precision"] == "bf16" else None


def _critical_path_row(row: dict, cfg: dict, model: Any, x: Any, amp_dtype: Any) -> dict:
    import concur

    module = concur.optimize(model, (x,), streams=4)
    trace = Path(cfg["out"]) / "traces" / (_file_stem(row["key"]) + ".json")
    bound = critical_path_bound(profile_plan_nodes(module.plan, (x,), trace, amp_dtype), module.plan)
    return dict(row, fwd_serial_us=bound.serial_us, fwd_critical_path_us=bound.critical_path_us,
                bound_speedup=bound.bound_speedup, nodes_measured=bound.nodes_measured,
                nodes_total=bound.nodes_total, trace=str(trace))


def prepare_mode(cfg: dict, row: dict, model: Any, x: Any, y: Any, amp_dtype: Any) -> PreparedMode:
    """Build the mode's step function, run its first step (the compile or capture: ``setup_s``), warm up.

    ``peak_mb`` is the allocator's peak over those steps beyond what was
    allocated before them: a step allocates the same every time, and a CUDA
    graph's pool is filled by its capture (reduce-overhead's within the
    warm-up steps).
    """
    import torch
    import torch.nn as nn

    import concur

    mode, kind = cfg["mode"], cfg["mode"].split(":")[0]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()

    def plain_loop(module: nn.Module, mark_step: bool = False) -> Callable[[], None]:
        def fn() -> None:
            if mark_step:  # reduce-overhead's docs: mark each iteration so graph outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                loss = loss_fn(module(x), y)
            loss.backward()
            opt.step()
        return fn

    def build() -> tuple[Callable[[], None], Any]:
        if kind == "eager":
            return plain_loop(model), None
        if kind == "compile":
            return plain_loop(torch.compile(model)), None
        if kind == "reduce_overhead":
            return plain_loop(torch.compile(model, mode="reduce-overhead"), mark_step=True), None
        # every concur path goes through train_step, as experiments/bench_train.py does
        streams = 1 if kind in ("serial_graph", "compile_graph") else _streams_arg(mode)
        step = concur.train_step(model, loss_fn, opt, (x, y), streams=streams, cuda_graph=kind != "eager_streams",
                                 compile=kind == "compile_graph" or kind in FUSED_MODES, amp_dtype=amp_dtype,
                                 compile_options=FUSED_OPTIONS.get(kind))
        return (lambda: step(x, y)), step

    # concur's warnings (e.g. "capturing with 4 streams failed, 1 stream") go into the row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, step = build()
        fn()  # the first step compiles or captures
        if cuda:
            torch.cuda.synchronize()
    row["setup_s"] = time.perf_counter() - t0
    row["warnings"] = sorted({str(w.message)[:400] for w in caught if "concur" in str(w.message)})
    if kind in COMPILING_MODES:  # where compile time goes: the largest of torch's own phase timers (s)
        row["compile_phases_s"] = compile_phases_s()
    for _ in range(cfg.get("warmup", 5)):  # reduce-overhead records its graphs in the first few steps
        fn()
    if cuda:
        torch.cuda.synchronize()
        row["peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return PreparedMode(row, fn, step, model, x, cuda)


def describe_mode(p: PreparedMode) -> dict:
    """Fill in what concur made of the model: streams, compiled graphs, the predicted speedup."""
    import concur

    row, step = p.row, p.train_step
    if step is not None:
        row["streams_requested"] = step.requested_streams
        row["graph_streams"] = next(iter(step.graphs.values())).streams if step.graphs else None
        if step.backends:
            row["compiled_graphs"] = compiled_graphs(step)
        if row["mode"].split(":")[0] in CONCUR_MODES:
            k = row["graph_streams"] or step.requested_streams
            seen = concur.inspect(p.model, (p.x,), max_streams=max(k, 1))
            row["predicted_speedup"] = seen.predicted_speedup.get(k)  # with contention (since 2026-11-23)
            row["ideal_speedup"] = seen.ideal_speedup.get(k)
    return row


def run_one(cfg: dict) -> dict:
    """Measure one configuration in this process; return its result row (errors are rows too)."""
    import torch

    row = _start_row(cfg)
    cuda = torch.cuda.is_available()
    status = _check_runnable(cfg, cuda)
    if status:
        return dict(row, status=status)
    model, x, y, amp_dtype = _model_and_batch(cfg, "cuda" if cuda else "cpu")
    if cfg["mode"] == "critical_path":
        return _critical_path_row(row, cfg, model, x, amp_dtype)
    turn = GpuTurn(cfg.get("gpu_lock"))
    turn.shared()  # with --compile-jobs N: compile and capture beside other children, time alone
    prepared = prepare_mode(cfg, row, model, x, y, amp_dtype)
    turn.exclusive()  # no other child's compile or capture runs kernels beside the timed steps
    _time_steps(row, cfg, prepared.step_fn, cuda)
    turn.release()
    return _describe_keeping_the_timing(prepared)


def run_interleaved(cfgs: list[dict]) -> list[dict]:
    """Set up the modes of one model, batch and precision one after another, then time them in turns.

    Each of ``rounds`` rounds steps every mode in order (a short warm-up, then
    ``repeats / rounds`` timed steps), so a drift of the GPU's clocks or of
    whatever else runs on the machine reaches every mode alike; their ratio is
    what the comparison needs. Compiling modes after the first reuse this
    process's inductor and Triton caches: their ``setup_s`` is not a first
    compile, and their rows say so. A mode that fails to set up is an error
    row; the others are still timed.
    """
    import torch

    cuda = torch.cuda.is_available()
    rows, prepared, first_compile = [], [], None
    turn = GpuTurn(cfgs[0].get("gpu_lock"))
    turn.shared()
    for cfg in cfgs:
        row = _start_row(cfg)
        row["timed_with"] = [c["mode"] for c in cfgs if c is not cfg]
        rows.append(row)
        try:
            status = _check_runnable(cfg, cuda)
            if status:
                row["status"] = status
                continue
            if cfg["mode"].split(":")[0] in COMPILING_MODES:
                if first_compile is not None:
                    row["compile_cache"] = f"warm: compiled after {first_compile} in the same process"
                first_compile = first_compile or cfg["mode"]
            model, x, y, amp_dtype = _model_and_batch(cfg, "cuda" if cuda else "cpu")
            if cfg["mode"] == "critical_path":
                rows[-1] = _critical_path_row(row, cfg, model, x, amp_dtype)
                continue
            prepared.append(prepare_mode(cfg, row, model, x, y, amp_dtype))
        except Exception as exc:  # noqa: BLE001 - a failing mode is a result; the others still run
            row.update(_error_fields(exc))
    turn.exclusive()
    _time_in_turns(prepared, cfgs[0])
    turn.release()
    for p in prepared:
        _describe_keeping_the_timing(p)
    return rows


def _time_in_turns(prepared: list[PreparedMode], cfg: dict) -> None:
    """Time the prepared modes in alternating rounds; each row gets its median, spread and utilization."""
    from concur.observe.timing import cuda_times_ms, median_and_iqr, wall_times_ms

    rounds = max(1, cfg.get("rounds", 5))
    per_round = max(1, cfg.get("repeats", 30) // rounds)
    rewarm = 2  # steps after switching modes: the other mode's kernels left the caches cold
    times: list[list[float]] = [[] for _ in prepared]
    for _ in range(rounds):
        for i, p in enumerate(prepared):
            times[i] += (cuda_times_ms if p.cuda else wall_times_ms)(p.step_fn, rewarm, per_round)
    for p, ts in zip(prepared, times):
        p.row["ms"], p.row["iqr_ms"] = median_and_iqr(ts)
        p.row["rounds"] = rounds
        if p.cuda:  # NVML samples every ~200 ms: each mode steps alone for a while for its utilization
            _under_nvml(p.row, cfg, p.step_fn, max(cfg.get("util_seconds", 0.0), 1.0))
        else:
            p.row["util_percent"] = None


def _under_nvml(row: dict, cfg: dict, fn: Callable[[], None], seconds: float,
                first: Callable[[], None] = lambda: None) -> None:
    """Run ``first``, then step ``fn`` until ``seconds`` have passed, under NVML; record the utilization."""
    import torch

    from concur.observe.monitor import Monitor, nvml_index

    monitor = Monitor(nvml_index()).start()
    monitor.mark("timed steps")
    t0 = time.monotonic()
    first()
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    record = monitor.stop()
    timed_s = record.phases()[-1][1] if record.marks else 0.0
    row["util_percent"] = record.mean_utilization(start_s=timed_s)
    row["timed_s"] = time.monotonic() - t0
    row["util_timeline"] = str(record.save(Path(cfg["out"]) / "util" / (_file_stem(row["key"]) + ".json")))


def _time_steps(row: dict, cfg: dict, fn: Callable[[], None], cuda: bool) -> None:
    """Time ``fn`` (the median of repeats after a warm-up) and fill the row's time and utilization."""
    from concur.observe.timing import time_cuda_ms, time_wall_ms

    warmup, repeats = cfg.get("warmup", 5), cfg.get("repeats", 30)
    if not cuda:
        row["ms"], row["iqr_ms"] = time_wall_ms(fn, warmup, repeats)
        row["util_percent"] = None
        return

    def timed() -> None:
        row["ms"], row["iqr_ms"] = time_cuda_ms(fn, warmup=warmup, repeats=repeats)
    # NVML reports a sample every ~200 ms: a timeline worth drawing needs seconds of steps
    _under_nvml(row, cfg, fn, cfg.get("util_seconds", 0.0), first=timed)


class GpuTurn:
    """A file lock that lets sweep children compile side by side but time one at a time.

    Compiling and capturing take it shared: they run kernels (autotuning, warm-up
    steps) only now and then. Timing takes it exclusive, so no other child's
    kernels run beside the timed steps. flock converts shared to exclusive by
    dropping the shared lock first, so two children that finish compiling
    together do not deadlock. Without a path it does nothing.
    """

    def __init__(self, path: str | None):
        self._file = open(path, "a") if path else None

    def _lock(self, how: int) -> None:
        if self._file is not None:
            fcntl.flock(self._file, how)

    def shared(self) -> None:
        self._lock(fcntl.LOCK_SH)

    def exclusive(self) -> None:
        self._lock(fcntl.LOCK_EX)

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the lock
            self._file = None


def compiled_graphs(step: Any) -> list[dict]:
    """What the concur backend made of each forward and backward graph of a ``train_step(compile=True)``."""
    # "strategy" and "segments" keep the keys of rows made when graphs could be cut into segments
    return [dict(backward=g.is_backward, strategy="kernels", segments=g.num_launches, streams=g.num_streams,
                 waits=g.num_waits, barriers=g.num_barriers, fallback=g.fallback_reason,
                 ideal_speedup=round(g.ideal_speedup, 4), predicted_speedup=round(g.predicted_speedup, 4))
            for backend in step.backends.values() for g in backend.graphs]


def compile_phases_s(top: int = 8) -> dict[str, float]:
    """The ``top`` longest compile phases torch timed in this process (nested phases overlap)."""
    from concur import _torch_compat as compat

    phases = sorted(compat.compile_phase_seconds().items(), key=lambda kv: -kv[1])[:top]
    return {name: round(seconds, 2) for name, seconds in phases}


def _root_cause(exc: BaseException) -> BaseException:
    """The first exception of a chain: fx's ShapeProp, for one, wraps an out-of-memory in its own RuntimeError."""
    seen = {id(exc)}
    while (earlier := exc.__cause__ or exc.__context__) is not None and id(earlier) not in seen:
        exc = earlier
        seen.add(id(exc))
    return exc


def _error_fields(exc: Exception) -> dict:
    """What a row records of the exception being handled: a failing mode is a result.

    The message names the root cause too, as the traceback's tail that a row
    keeps may not reach it.
    """
    error = f"{type(exc).__name__}: {exc}"
    root = _root_cause(exc)
    if root is not exc:
        error = f"{type(root).__name__}: {str(root)[:500]} (raised as {error})"
    return dict(status="error", error=error, traceback=traceback.format_exc()[-2000:])


def _describe_keeping_the_timing(p: PreparedMode) -> dict:
    """``describe_mode``, but a failure to describe leaves the measured times in the row.

    Describing runs concur's analysis on the GPU after the timing, outside the
    GPU lock, beside other children; if it fails (say, out of memory) the row
    keeps its timing and records why it has no prediction.
    """
    try:
        return describe_mode(p)
    except Exception as exc:  # noqa: BLE001 - the timing is already measured; it must not be lost
        p.row["describe_error"] = _error_fields(exc)["error"]
        return p.row


def _row_or_error(cfg: dict) -> dict:
    started = time.time()
    try:
        row = run_one(cfg)
    except Exception as exc:  # a failing mode is a result
        row = dict(cfg, key=config_key(cfg), started=started, **_error_fields(exc))
        row.pop("fail", None)
    row.update(run_meta())
    return row


def child_main(config_json: str) -> int:
    """Entry of ``--one``: print exactly one JSON row on stdout's last line."""
    print(json.dumps(_row_or_error(json.loads(config_json)), default=str), flush=True)
    return 0


def child_group_main(configs_json: str) -> int:
    """Entry of ``--group``: one JSON row per configuration, printed as each finishes.

    A group of modes to time together (``--together``) prints its rows at the end.
    """
    import gc

    import torch

    cfgs = json.loads(configs_json)
    if cfgs and cfgs[0].get("together"):
        try:
            rows = run_interleaved(cfgs)
        except Exception as exc:  # noqa: BLE001 - outside one mode's setup: every row of the group says so
            rows = [dict(c, key=config_key(c), started=time.time(), **_error_fields(exc)) for c in cfgs]
        for row in rows:
            row.pop("fail", None)
            row.update(run_meta())
            print(json.dumps(row, default=str), flush=True)
        return 0
    for cfg in cfgs:
        print(json.dumps(_row_or_error(cfg), default=str), flush=True)
        gc.collect()  # the previous mode's graphs and memory pools must not count in the next peak
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


# --------------------------------------------------------------------------- the sweep (parent)


def _run_child(flag: str, payload: Any, timeout_s: float, extra_env: dict[str, str] | None = None
               ) -> tuple[str, tuple[str, str] | None]:
    """Run ``python -m experiments.sweep <flag> <json>``; return its stdout and (error, stderr tail) or None."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **(extra_env or {}))
    try:
        proc = subprocess.run([sys.executable, "-m", "experiments.sweep", flag, json.dumps(payload)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        return (out.decode(errors="replace") if isinstance(out, bytes) else out,
                (f"timeout after {timeout_s:.0f} s", ""))
    if proc.returncode != 0:
        return proc.stdout, (f"subprocess exited with {proc.returncode} (crash or OOM kill?)",
                             (proc.stderr or "")[-1500:])
    return proc.stdout, None


def _rows_printed(stdout: str) -> dict[str, dict]:
    return {row["key"]: row for row in (json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{"))}


def _error_row(cfg: dict, meta: dict, message: str, stderr_tail: str) -> dict:
    row = dict(cfg, key=config_key(cfg), started=time.time(), **meta, status="error", error=message,
               stderr_tail=stderr_tail)
    row.pop("fail", None)
    return row


@contextlib.contextmanager
def compile_caches(cfgs: list[dict]) -> Iterator[dict[str, str] | None]:
    """Empty inductor and Triton caches for a child that compiles cold; None (the shared ones) otherwise.

    A kernel another configuration already compiled would otherwise make a
    compile time look shorter than a user's first run.
    """
    if not any(c.get("compile_cache") == "cold" for c in cfgs):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="concur-sweep-cache-") as cache:
        yield {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}


def run_in_subprocess(cfg: dict, timeout_s: float, meta: dict) -> dict:
    """Run one configuration in a fresh interpreter; a crash or timeout becomes an error row."""
    with compile_caches([cfg]) as extra_env:
        stdout, error = _run_child("--one", cfg, timeout_s, extra_env)
    row = _rows_printed(stdout).get(config_key(cfg))
    if error is None and row is not None:
        return row
    return _error_row(cfg, meta, *(error or ("the child printed no row", "")))


def run_group_in_subprocess(cfgs: list[dict], timeout_s: float, meta: dict) -> list[dict]:
    """Run configurations in one fresh interpreter; what a crash or hang left undone runs one per child."""
    if len(cfgs) == 1:
        return [run_in_subprocess(cfgs[0], timeout_s, meta)]
    with compile_caches(cfgs) as extra_env:
        stdout, error = _run_child("--group", cfgs, timeout_s * len(cfgs), extra_env)
    rows = _rows_printed(stdout)
    result = []
    for i, cfg in enumerate(cfgs):
        if config_key(cfg) in rows:
            result.append(rows[config_key(cfg)])
            continue
        # the child died on this configuration: record it, run the rest one per child
        result.append(_error_row(cfg, meta, *(error or ("the child printed no row for it", ""))))
        result.extend(run_in_subprocess(c, timeout_s, meta) for c in cfgs[i + 1:])
        break
    return result


def group_configs(configs: list[dict]) -> list[list[dict]]:
    """Group configurations that share a child: modes to time together, or consecutive non-compiling modes.

    Both must be of one model, batch and precision. Every other compiling
    configuration gets a child of its own.
    """
    groups: list[list[dict]] = []
    for cfg in configs:
        last = groups[-1][-1] if groups else None
        same_point = last is not None and all(last[k] == cfg[k] for k in ("model", "batch", "precision"))
        if cfg.get("together") or (last is not None and last.get("together")):
            same = same_point and cfg.get("together") == last.get("together")
        else:
            same = same_point and last["mode"].split(":")[0] not in COMPILING_MODES and \
                cfg["mode"].split(":")[0] not in COMPILING_MODES
        if same:
            groups[-1].append(cfg)
        else:
            groups.append([cfg])
    return groups


WAVE_CAPACITY_PER_80GB = 1536
"""Sum of child sizes (batch x modes x 2 for fp32) a wave may hold on an 80 GB GPU: three Inception-v3
batch-128 fp32 pairs (size 512, about 21 GB each) fit on the H100. Scaled to other GPUs by their memory."""


def memory_waves(groups: list[list[dict]], jobs: int,
                 capacity: int = WAVE_CAPACITY_PER_80GB) -> list[list[list[dict]]]:
    """Split groups into waves of at most ``jobs`` whose memory, roughly estimated, stays within ``capacity``.

    Children of one wave hold their models, graphs and memory pools at once;
    in sweep order a wave would be one model's largest batches together, which
    does not fit in an 80 GB GPU for Inception-v3 at batch 128. The estimate is
    batch x modes in the child x 2 for fp32: enough to keep the large ones apart.
    The capacity is absolute, not relative to the largest child, so a resumed
    sweep of small batches still runs ``jobs`` at once; a child larger than it
    runs alone.
    """
    def size(g: list[dict]) -> int:
        return g[0]["batch"] * len(g) * (1 if g[0]["precision"] == "bf16" else 2)

    left = sorted(groups, key=size, reverse=True)
    waves = []
    while left:
        wave, used = [], 0
        for g in list(left):
            if len(wave) < jobs and (not wave or used + size(g) <= capacity):
                wave.append(g)
                used += size(g)
                left.remove(g)
        waves.append(wave)
    return waves


def wave_capacity() -> int:
    """``WAVE_CAPACITY_PER_80GB`` scaled to this machine's GPU memory (unscaled without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return WAVE_CAPACITY_PER_80GB
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return int(WAVE_CAPACITY_PER_80GB * gib / 79.2)  # the H100 80GB reports 79.2 GiB


def read_rows(path: Path) -> list[dict]:
    """Return the rows of a results.jsonl; a line cut off by an interruption is ignored."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def _fmt_s(s: float) -> str:
    return f"{s / 60:.0f}m{s % 60:02.0f}s" if s >= 60 else f"{s:.0f}s"


class Progress:
    """One stderr line per finished configuration: count, percent, elapsed and estimated time left."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.time()

    def update(self, key: str, status: str) -> None:
        self.done += 1
        elapsed = time.time() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        width = 24
        bar = "#" * round(width * self.done / self.total)
        print(f"[{bar:<{width}}] {self.done}/{self.total} {100 * self.done / self.total:3.0f}%  "
              f"elapsed {_fmt_s(elapsed)}  left ~{_fmt_s(left)}  {key}: {status[:60]}", file=sys.stderr, flush=True)


def ordered_modes(modes: list[str], together: list[list[str]]) -> list[str]:
    """The modes in sweep order: each ``--together`` set in its own order, where its first mode stands."""
    ordered, placed = [], set()
    for mode in modes:
        if mode in placed:
            continue
        group = next((g for g in together if mode in g), [mode])
        ordered += group
        placed.update(group)
    return ordered


def make_configs(args: argparse.Namespace) -> list[dict]:
    """Return the configurations to run, in sweep order; critical_path once per model/batch/precision."""
    together = [t.split(",") for t in getattr(args, "together", None) or []]
    tag = {m: ",".join(g) for g in together for m in g}
    configs = []
    for precision in args.precisions:
        for model in args.models:
            for batch in args.batches:
                for mode in ordered_modes(args.modes, together):
                    cfg = dict(model=model, batch=batch, precision=precision, mode=mode, repeats=args.repeats,
                               util_seconds=args.util_seconds,
                               warmup=args.warmup, out=str(args.out))
                    if args.image_size:
                        cfg["image_size"] = args.image_size
                    if mode in tag:
                        cfg.update(together=tag[mode], rounds=getattr(args, "rounds", 5))
                    if mode.split(":")[0] in COMPILING_MODES:
                        cfg["compile_cache"] = "shared" if args.shared_compile_cache else "cold"
                    if mode != "critical_path" and getattr(args, "compile_jobs", 1) > 1:
                        # compiles and captures run side by side, each timed alone; setup_s is not a lone one
                        cfg["compile_jobs"] = args.compile_jobs
                        cfg["gpu_lock"] = str(Path(args.out) / ".gpu.lock")
                    for spec in args.inject_failure:
                        needle, _, how = spec.rpartition("=")
                        if needle == config_key(cfg):
                            cfg["fail"] = how
                    configs.append(cfg)
    return configs


def sweep(configs: list[dict], out: Path, resume: bool, timeout_s: float) -> tuple[list[dict], int]:
    """Run the configurations not yet in ``out/results.jsonl``; return (all rows, launched count)."""
    import torch  # noqa: F401 - run_meta's imports, once in the parent

    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "results.jsonl"
    if jsonl.exists() and not resume:
        raise SystemExit(f"{jsonl} exists: pass --resume to continue that run, or another --out")
    if jsonl.exists() and jsonl.read_text()[-1:] not in ("", "\n"):
        with open(jsonl, "a") as f:  # a line cut by the interruption must not swallow the next row
            f.write("\n")
    done = {r["key"] for r in read_rows(jsonl)}
    todo = [c for c in configs if config_key(c) not in done]
    print(f"{len(configs)} configurations, {len(configs) - len(todo)} already in {jsonl}, running {len(todo)}",
          file=sys.stderr, flush=True)
    meta = run_meta()
    progress = Progress(len(todo))
    written = threading.Lock()

    def run(group: list[dict]) -> None:
        for row in run_group_in_subprocess(group, timeout_s, meta):
            with written, open(jsonl, "a") as f:  # appended at once: an interrupted sweep keeps every finished row
                f.write(json.dumps(row, default=str) + "\n")
                progress.update(row["key"], row["status"] if row["status"] != "error" else "ERROR " + row["error"])

    groups = group_configs(todo)
    side_by_side = [g for g in groups if g[0].get("gpu_lock")]
    for group in groups:  # first whatever times alone, then the children that share the machine
        if not group[0].get("gpu_lock"):
            run(group)
    jobs = side_by_side[0][0]["compile_jobs"] if side_by_side else 1
    # in waves: a child starting to compile while others wait to time would hold them up (GpuTurn)
    for wave in memory_waves(side_by_side, jobs, wave_capacity()):
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            for done in concurrent.futures.as_completed([pool.submit(run, g) for g in wave]):
                done.result()
    return read_rows(jsonl), len(todo)


def combine_runs(sources: list[Path], out: Path) -> list[dict]:
    """Write ``out/results.jsonl`` as the union of the runs in ``sources``; return its rows.

    A sweep too long for one sitting is measured in parts, each its own run
    directory; the union is the whole sweep. Where two parts measured the same
    configuration the later source wins. Each row keeps its own date and gains
    ``source``, the directory it came from. ``out`` must not hold a measured run:
    only a previous union is replaced, so no measurement is overwritten.
    """
    jsonl = out / "results.jsonl"
    if any("source" not in r for r in read_rows(jsonl)):
        raise SystemExit(f"{jsonl} holds measured rows; --combine writes only to a new or combined directory")
    by_key: dict[str, dict] = {}
    for src in sources:
        rows = read_rows(src / "results.jsonl")
        if not rows:
            raise SystemExit(f"no rows in {src / 'results.jsonl'}")
        for r in rows:
            by_key.pop(r["key"], None)  # the later source's row, in the later source's order
            by_key[r["key"]] = dict(r, source=str(r.get("source", src)))
    out.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("".join(json.dumps(r, default=str) + "\n" for r in by_key.values()))
    return list(by_key.values())


# --------------------------------------------------------------------------- reports


def _meta_line(meta: dict) -> str:
    return f"{meta['date']}, {meta['gpu']}, driver {meta['driver']}, torch {meta['torch']}"


def best_speedups(rows: list[dict]) -> list[dict]:
    """Per (model, precision, batch): best concur mode time, best alternative, and their ratio."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("ms"):
            groups.setdefault((r["model"], r["precision"], r["batch"]), []).append(r)
    for (model, precision, batch), rs in sorted(groups.items()):
        ours = [r for r in rs if r["mode"].split(":")[0] in CONCUR_MODES]
        alts = [r for r in rs if r["mode"].split(":")[0] not in CONCUR_MODES]
        if ours and alts:
            o, a = min(ours, key=lambda r: r["ms"]), min(alts, key=lambda r: r["ms"])
            out.append(dict(model=model, precision=precision, batch=batch, concur_mode=o["mode"], concur_ms=o["ms"],
                            best_alternative=a["mode"], alternative_ms=a["ms"], speedup=a["ms"] / o["ms"]))
    return out


def bound_rows(rows: list[dict]) -> list[dict]:
    """Per (model, precision, batch) with a critical_path row: bound vs achieved (concur graph vs serial graph)."""
    out = []
    for cp in (r for r in rows if r["mode"] == "critical_path" and r.get("status") == "ok"):
        same = [r for r in rows if (r["model"], r["precision"], r["batch"]) == (cp["model"], cp["precision"], cp["batch"])
                and r.get("status") == "ok" and r.get("ms")]
        serial = next((r for r in same if r["mode"] == "serial_graph"), None)
        graphs = [r for r in same if r["mode"].startswith("concur_graph")]
        achieved = serial["ms"] / min(r["ms"] for r in graphs) if serial and graphs else None
        out.append(dict(model=cp["model"], precision=cp["precision"], batch=cp["batch"],
                        fwd_serial_us=cp["fwd_serial_us"], fwd_critical_path_us=cp["fwd_critical_path_us"],
                        bound_speedup=cp["bound_speedup"], achieved_speedup=achieved,
                        achieved_over_bound=achieved / cp["bound_speedup"] if achieved else None))
    return out


def write_reports(rows: list[dict], meta: dict, out: Path) -> list[Path]:
    """Write results.json, results.csv, summary.md and speedup plots; return their paths."""
    written = []
    path = out / "results.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    written.append(path)

    path = out / "results.csv"
    skip = {"traceback", "stderr_tail"}
    fields = ["date", "gpu", "driver", "torch"] + sorted({k for r in rows for k in r} - skip - {"date", "gpu", "driver", "torch"})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**{k: meta[k] for k in ("date", "gpu", "driver", "torch")}, **r})
    written.append(path)

    written += plot_speedups(rows, meta, out)
    written += plot_bounds(rows, meta, out)
    written += plot_utilization_timelines(rows, meta, out)
    path = out / "summary.md"
    path.write_text(summary_markdown(rows, meta, [p.name for p in written if p.suffix == ".png"]))
    written.append(path)
    return written


def mode_table_markdown(rows: list[dict]) -> list[str]:
    """Step time (ms) of every mode side by side, a line per model, precision and batch; then the best ratio.

    A mode that failed shows ``error``; one not run, ``-``. The last column is
    the best concur mode over the best alternative, as in ``best_speedups``.
    """
    timed = [r for r in rows if r.get("mode") != "critical_path"]
    present = {r["mode"] for r in timed}
    modes = [m for m in ALL_MODES if m in present] + sorted(present - set(ALL_MODES))
    if not modes:
        return []
    cell = {(r["model"], r["precision"], r["batch"], r["mode"]): r for r in timed}
    best = {(b["model"], b["precision"], b["batch"]): b for b in best_speedups(rows)}
    lines = ["", "## Step time per mode (ms)", "",
             f"| model | precision | batch | {' | '.join(modes)} | best concur / best alternative |",
             "|---|---|---|" + "---|" * (len(modes) + 1)]
    for key in sorted({k[:3] for k in cell}):
        values = []
        for m in modes:
            r = cell.get((*key, m))
            values.append("-" if r is None else f"{r['ms']:.2f}" if r.get("ms") else r.get("status", "?").split(":")[0])
        b = best.get(key)
        ratio = f"{b['speedup']:.2f}x ({b['concur_mode']} / {b['best_alternative']})" if b else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {' | '.join(values)} | {ratio} |")
    return lines


def summary_markdown(rows: list[dict], meta: dict, plots: list[str]) -> str:
    """Return the Markdown summary: every configuration, the speedups, the bounds, the failures."""
    lines = [f"# Sweep: {_meta_line(meta)}", "",
             f"CUDA {meta.get('cuda')}, concur {meta.get('concur')}. {len(rows)} configurations; "
             "times are medians with the interquartile range; speedups compare modes of the same sweep.", ""]
    sources: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("source"):
            sources.setdefault(r["source"], []).append(r)
    if sources:
        lines += ["Combined from these runs (`--combine`; the later wins where both measured a configuration):", "",
                  *[f"- `{src}`: {len(rs)} rows, {' + '.join(sorted({str(r.get('date')) for r in rs}))}"
                    for src, rs in sources.items()], ""]
    lines += ["| model | precision | batch | mode | status | ms (iqr) | setup s | peak MB | util % | predicted |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    num = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in sorted(rows, key=lambda r: (r["model"], r["precision"], r["batch"], r["mode"])):
        status = r.get("status", "")
        ms = f"{r['ms']:.2f} ({r['iqr_ms']:.2f})" if r.get("ms") else ""
        lines.append(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['mode']} | {status} | {ms} | "
                     f"{num(r.get('setup_s'), '.1f')}{'*' if r.get('compile_jobs') else ''} | "
                     f"{num(r.get('peak_mb'), '.0f')} | "
                     f"{num(r.get('util_percent'), '.0f')} | {num(r.get('predicted_speedup'), '.2f')} |")
    if any(r.get("compile_jobs") for r in rows):
        lines += ["", "\\* compiled beside other configurations (`--compile-jobs`): not a lone compile time; "
                  "step times were measured alone."]
    lines += mode_table_markdown(rows)
    best = best_speedups(rows)
    if best:
        lines += ["", "## Best concur mode vs best alternative", "",
                  "| model | precision | batch | concur mode | ms | best alternative | ms | speedup |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {b['model']} | {b['precision']} | {b['batch']} | {b['concur_mode']} | {b['concur_ms']:.2f} | "
                  f"{b['best_alternative']} | {b['alternative_ms']:.2f} | {b['speedup']:.2f}x |" for b in best]
    bounds = bound_rows(rows)
    if bounds:
        lines += ["", "## Critical-path bound (forward DAG, measured kernel times)", "",
                  "The bound is the forward pass's serial kernel time over its longest dependency path; "
                  "achieved is serial graph over the best concur graph, for the whole step.", "",
                  "| model | precision | batch | fwd serial µs | critical path µs | bound | achieved | achieved/bound |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {b['model']} | {b['precision']} | {b['batch']} | {b['fwd_serial_us']:.0f} | "
                  f"{b['fwd_critical_path_us']:.0f} | {b['bound_speedup']:.2f}x | {num(b['achieved_speedup'], '.2f')} | "
                  f"{num(b['achieved_over_bound'], '.2f')} |" for b in bounds]
    errors = [r for r in rows if r.get("status") == "error"]
    if errors:
        lines += ["", "## Failures (results, not the end of the sweep)", ""]
        lines += [f"- `{r['key']}`: {r['error'][:300]}" for r in errors]
    lines += ["", *[f"![{p}]({p})" for p in plots], ""]
    return "\n".join(lines)


def save_figure(fig: Any, path: Path, meta: dict) -> Path:
    """Save a figure with the run's date, GPU, driver and torch in its PNG metadata, then close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Description": json.dumps(meta)})
    plt.close(fig)
    return path


def plot_speedups(rows: list[dict], meta: dict, out: Path) -> list[Path]:
    """Plot, per precision, best concur mode over best alternative vs batch size, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_speedups(rows)
    paths = []
    for precision in sorted({b["precision"] for b in best}):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for model in sorted({b["model"] for b in best if b["precision"] == precision}):
            pts = sorted((b["batch"], b["speedup"]) for b in best if (b["model"], b["precision"]) == (model, precision))
            ax.plot(*zip(*pts), marker="o", label=model)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup: best concur mode / best alternative")
        ax.set_title(f"{precision}: {_meta_line(meta)}", fontsize=9)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out / f"speedup_{precision}.png", meta))
    return paths


def plot_bounds(rows: list[dict], meta: dict, out: Path) -> list[Path]:
    """Achieved speedup (serial graph / best concur graph) beside the critical-path bound, per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds = [b for b in bound_rows(rows) if b["achieved_speedup"]]
    if not bounds:
        return []
    fig, ax = plt.subplots(figsize=(max(7, 0.32 * len(bounds)), 4.5))
    labels = [f"{b['model']} {b['precision']} b{b['batch']}" for b in bounds]
    xs = range(len(bounds))
    ax.bar([x - 0.2 for x in xs], [b["bound_speedup"] for b in bounds], 0.4, label="bound (forward critical path)")
    ax.bar([x + 0.2 for x in xs], [b["achieved_speedup"] for b in bounds], 0.4, label="achieved (whole step)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(xs), labels, rotation=75, fontsize=7)
    ax.set_ylabel("speedup over the serial CUDA graph")
    ax.set_title(f"time vs bound: {_meta_line(meta)}", fontsize=9)
    ax.legend(fontsize=8)
    return [save_figure(fig, out / "bound.png", meta)]


def plot_utilization_timelines(rows: list[dict], meta: dict, out: Path) -> list[Path]:
    """NVML utilization over the timed steps, one line per mode, per model and precision at one batch.

    The smallest batch is drawn: that is where a step is launch-bound and the
    modes differ most in how busy they keep the GPU. Each mode's timed phase
    becomes one phase of a merged record, placed after the previous mode's.
    """
    from dataclasses import replace

    from concur.observe.monitor import Mark, MonitorRecord
    from concur.observe.report import plot_utilization

    paths = []
    saved = [r for r in rows if r.get("util_timeline") and Path(r["util_timeline"]).exists()]
    for model, precision in sorted({(r["model"], r["precision"]) for r in saved}):
        mine = [r for r in saved if (r["model"], r["precision"]) == (model, precision)]
        batch = min(r["batch"] for r in mine)
        records, samples, utilization, marks, offset = [], [], [], [], 0.0
        for r in sorted((r for r in mine if r["batch"] == batch), key=lambda r: r["mode"]):
            rec = MonitorRecord.load(r["util_timeline"])
            timed = rec.phases()[-1][1] if rec.marks else 0.0
            shift = offset - timed
            samples += [replace(x, t_s=x.t_s + shift) for x in rec.samples if x.t_s >= timed]
            utilization += [replace(u, t_s=u.t_s + shift) for u in rec.utilization if u.t_s >= timed - 0.2]
            marks.append(Mark(offset, r["mode"]))
            offset += max(rec.duration_s - timed, 0.25)
            records.append(rec)
        if not samples:
            continue
        merged = replace(records[0], samples=samples, utilization=utilization, marks=marks, duration_s=offset)
        path = plot_utilization(merged, f"{model} {precision} b{batch}",
                                out / f"util_{_file_stem(model)}_{precision}_b{batch}.png")
        if path:
            paths.append(path)
    return paths


def default_out(meta: dict) -> Path:
    gpu = "".join(c if c.isalnum() else "-" for c in meta["gpu"].lower()).strip("-")
    return REPO / "experiments" / "results" / f"{meta['date']}-{gpu}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", metavar="JSON", help="internal: run one configuration, print its row")
    parser.add_argument("--group", metavar="JSON", help="internal: run a list of configurations, a row each")
    parser.add_argument("--models", nargs="+", help="default: torchvision three, branchy:8x64, branchy:4x128, nascell")
    parser.add_argument("--batches", nargs="+", type=int, help=f"default {DEFAULT_BATCHES}")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS,
                        help="bf16 = bf16 autocast + channels-last model and inputs; fp32-cl = fp32 with a "
                             "channels-last model and inputs (default fp32 bf16)")
    parser.add_argument("--modes", nargs="+", help=f"default: {' '.join(ALL_MODES)}")
    parser.add_argument("--out", type=Path, help="run directory (default experiments/results/<date>-<gpu>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out, skipping finished configs")
    parser.add_argument("--timeout-per-config", type=float, default=900.0, help="seconds (default 900)")
    parser.add_argument("--shared-compile-cache", action="store_true",
                        help="compiling modes reuse the caches in TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR "
                             "(faster reruns; their setup_s is then not a first compile). Default: empty caches")
    parser.add_argument("--compile-jobs", type=int, default=1, metavar="N",
                        help="run up to N compiling configurations at once; they compile side by side and "
                             "time one at a time (a lock), so their setup_s is not a lone compile. Default 1")
    parser.add_argument("--together", action="append", default=[], metavar="MODE,MODE[,...]",  # or MODE+MODE
                        help="time these modes of each model, batch and precision in one process, in alternating "
                             "rounds (so a drift of clocks or load hits them alike); repeatable. The first "
                             "compiling mode of a set compiles cold, the later ones reuse its caches")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of a --together set (default 5)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--image-size", type=int, help="override every model's input size")
    parser.add_argument("--util-seconds", type=float, default=0.0,
                        help="keep stepping until the timed phase lasts this long, for NVML's utilization "
                             "timeline (it samples every ~200 ms); default 0: the timed repeats only")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite the reports of the run in --out (e.g. after an interrupted sweep)")
    parser.add_argument("--combine", nargs="+", type=Path, metavar="RUN_DIR",
                        help="write --out as the union of these run directories (the later wins per "
                             "configuration; rows keep their date and gain 'source'), then its reports")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"tiny defaults that finish on CPU: {SMOKE['models']}, batch {SMOKE['batches']}, "
                             f"{SMOKE['image_size']}px, modes {SMOKE['modes']}")
    parser.add_argument("--inject-failure", nargs="*", default=[], metavar="KEY=raise|crash",
                        help="testing the sweep itself: the configuration model|batch|precision|mode raises or aborts")
    args = parser.parse_args(argv)
    if args.one:
        return child_main(args.one)
    if args.group:
        return child_group_main(args.group)
    from experiments.sweep_models import DEFAULT_MODELS

    if args.compile_jobs < 1:
        parser.error(f"--compile-jobs must be at least 1, got {args.compile_jobs}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    smoke = SMOKE if args.cpu_smoke else {}
    args.models = args.models or smoke.get("models") or DEFAULT_MODELS
    args.batches = args.batches or smoke.get("batches") or DEFAULT_BATCHES
    args.precisions = args.precisions or smoke.get("precisions") or ["fp32", "bf16"]
    args.modes = args.modes or smoke.get("modes") or list(ALL_MODES)
    args.image_size = args.image_size or smoke.get("image_size")
    args.together = [t.replace("+", ",") for t in args.together]  # '+' where commas are taken (gpu_check.sh)
    listed = set(args.modes)
    seen: set[str] = set()
    for t in args.together:
        group = t.split(",")
        if len(group) < 2 or not set(group) <= listed or seen & set(group) or len(set(group)) < len(group):
            parser.error(f"--together {t!r}: name two or more of the --modes ({' '.join(args.modes)}), "
                         "each in one set only")
        seen |= set(group)
    if args.cpu_smoke:
        args.repeats, args.warmup = min(args.repeats, SMOKE["repeats"]), min(args.warmup, 1)
    if args.combine and not args.out:
        parser.error("--combine needs --out, a new directory for the union")
    meta = run_meta()
    args.out = args.out or default_out(meta)
    if args.combine:
        rows, launched = combine_runs(args.combine, args.out), 0
    elif args.report_only:
        rows, launched = read_rows(args.out / "results.jsonl"), 0
        if not rows:
            raise SystemExit(f"no rows in {args.out / 'results.jsonl'}")
    else:
        rows, launched = sweep(make_configs(args), args.out, args.resume, args.timeout_per_config)
    for path in write_reports(rows, meta_of_rows(rows, meta), args.out):
        print(path, file=sys.stderr)
    print(f"launched {launched} configuration(s); {len(rows)} rows in {args.out / 'results.jsonl'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

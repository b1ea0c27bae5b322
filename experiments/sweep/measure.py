"""Inside a child: set up each configuration's mode, time it, describe it, and print its row.

A failing mode is a result, not the end of the child: its row records the
error (and its root cause), and the other modes of the child still run.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from experiments.sweep.bounds import critical_path_bound, profile_plan_nodes
from experiments.sweep.children import GpuTurn
from experiments.sweep.configs import (CHANNELS_LAST_PRECISIONS, COMPILING_MODES, CONCUR_MODES, CUDA_MODES,
                                       FUSED_MODES, FUSED_OPTIONS, PEER_MODES, config_key, file_stem, mode_kind)
from experiments.sweep.memory import FIELDS as MEMORY_FIELDS, MemoryPeaks
from experiments.sweep.rows import run_meta
from experiments.sweep.timing import PreparedMode, time_in_turns, time_steps


def _streams_arg(mode: str) -> int | str:
    k = mode.split(":", 1)[1] if ":" in mode else "1"
    return "auto" if k == "auto" else int(k)


def _start_row(cfg: dict) -> dict:
    """The row of a configuration, before anything ran."""
    row = dict(cfg, key=config_key(cfg), started=time.time(), status="ok", peak_mb=None,
               **dict.fromkeys(MEMORY_FIELDS))
    row.pop("fail", None)
    return row


def _check_runnable(cfg: dict, cuda: bool) -> str | None:
    """Return the final status of a configuration that does not run here, after injected failures."""
    if mode_kind(cfg["mode"]) in CUDA_MODES and not cuda:
        return "skipped: no CUDA"
    if cfg.get("fail") == "raise":
        raise RuntimeError("forced failure (--inject-failure)")
    if cfg.get("fail") == "crash":
        os.abort()  # as a segfault or the OOM killer would: no row from the child at all
    return None


def model_and_batch(cfg: dict, device: str) -> tuple[Any, Any, Any, Any]:
    """Return the seeded model in the configuration's layout, one batch, and the bf16 autocast dtype (or None)."""
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
    trace = Path(cfg["out"]) / "traces" / (file_stem(row["key"]) + ".json")
    bound = critical_path_bound(profile_plan_nodes(module.plan, (x,), trace, amp_dtype), module.plan)
    return dict(row, fwd_serial_us=bound.serial_us, fwd_critical_path_us=bound.critical_path_us,
                bound_speedup=bound.bound_speedup, nodes_measured=bound.nodes_measured,
                nodes_total=bound.nodes_total, trace=str(trace))


def prepare_mode(cfg: dict, row: dict, model: Any, x: Any, y: Any, amp_dtype: Any,
                 turn: GpuTurn | None = None) -> PreparedMode:
    """Build the mode's step function, run its first step (the compile or capture: ``setup_s``), warm up.

    The setup's memory peaks, allocated and reserved, are the allocator's over
    those steps beyond what was held before them (:mod:`experiments.sweep.memory`;
    ``peak_mb`` is the allocated one, the name older rows have): a step
    allocates the same every time, and a CUDA graph's pool is filled by its
    capture (reduce-overhead's within the warm-up steps).
    """
    import torch
    import torch.nn as nn

    import concur

    mode, kind = cfg["mode"], mode_kind(cfg["mode"])
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # foreach on CUDA: torch's default step
    if cuda and kind in CONCUR_MODES:
        # a cold decision cache per configuration, as on a user's first run: setup_s includes the measured
        # decisions, and experiments/calibrate.py reads what was measured from <out>/decisions/
        os.environ["CONCUR_CACHE_DIR"] = str(Path(cfg["out"]) / "decisions" / file_stem(row["key"]))
        if cfg.get("gpu_lock"):  # children compiling side by side time their decisions one at a time
            os.environ["CONCUR_MEASURE_LOCK"] = cfg["gpu_lock"] + ".measure"
    memory = MemoryPeaks(cuda)
    memory.begin_setup()
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
        if kind in PEER_MODES:  # PyTorch's recipe as a user writes it, without concur: the baseline
            from experiments import peers

            peer = peers.RECIPES[kind.removeprefix("peer_")](model, loss_fn, opt, (x, y), amp_dtype)
            return (lambda: peer(x, y)), None
        # every concur path goes through train_step, as a user's does; serial_graph and
        # compile_graph are concur's own step on one stream, not PyTorch's recipe (the peer_* modes are)
        streams = 1 if kind in ("serial_graph", "compile_graph") else _streams_arg(mode)
        step = concur.train_step(model, loss_fn, opt, (x, y), streams=streams, cuda_graph=kind != "eager_streams",
                                 compile=kind == "compile_graph" or kind in FUSED_MODES, amp_dtype=amp_dtype,
                                 compile_options=FUSED_OPTIONS.get(kind), stream_priority=kind != "fused_noprio",
                                 split_weight_grads=False if kind == "concur_graph_nosplit" else None)
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
    if getattr(step, "deciding", False):
        # an unfused step times its programs on its first calls (concur.training.trial), alone on the GPU: no other
        # child's compile, capture or warm-up beside it (``turn``, held shared while setting up), as a user's
        # process would run them: beside other children a program can time at twice its own time (GoogLeNet b64's
        # 4-stream program, 22.9 ms against 10.4 alone) and a faster program be dropped. The warm-up below
        # captures the chosen program.
        if turn is not None:
            turn.exclusive()
        for _ in range(200):
            fn()
            if not getattr(step, "deciding", False):
                break
        if turn is not None:
            turn.shared()
    for _ in range(cfg.get("warmup", 5)):  # reduce-overhead records its graphs in the first few steps
        fn()
    memory.end_setup(row)
    return PreparedMode(row, fn, step, model, x, cuda, memory)


def describe_mode(p: PreparedMode) -> dict:
    """Fill in what concur made of the model: streams, compiled graphs, the predicted speedup."""
    import concur

    row, step = p.row, p.train_step
    if step is not None:
        row["streams_requested"] = step.requested_streams
        row["graph_streams"] = next(iter(step.graphs.values())).streams if step.graphs else None
        if step.backends:
            row["compiled_graphs"] = compiled_graphs(step)
        # the decisions over the whole step (concur.training.step_streams): kept, measured speedup, source
        row["step_decisions"] = [dict(keep=d.keep, source=d.source, measured_speedup=d.measured.speedup
                                      if d.measured else None, predicted_speedup=round(d.prediction.speedup, 4))
                                 for d in getattr(step, "step_decisions", [])]
        if mode_kind(row["mode"]) in CONCUR_MODES:
            k = row["graph_streams"] or step.requested_streams
            seen = concur.inspect(p.model, (p.x,), max_streams=max(k, 1))
            row["predicted_speedup"] = seen.predicted_speedup.get(k)  # with contention
            row["ideal_speedup"] = seen.ideal_speedup.get(k)
    return row


def compiled_graphs(step: Any) -> list[dict]:
    """What the concur backend made of each forward and backward graph of a ``train_step(compile=True)``."""
    # "strategy" and "segments" keep the keys of rows made when graphs could be cut into segments
    return [dict(backward=g.is_backward, strategy="kernels", segments=g.num_launches, streams=g.num_streams,
                 waits=g.num_waits, barriers=g.num_barriers, fallback=g.fallback_reason,
                 ideal_speedup=round(g.ideal_speedup, 4), predicted_speedup=round(g.predicted_speedup, 4),
                 one_stream=g.one_stream_reason, convolutions_split=g.convolutions_split,
                 weight_grad_ops=g.weight_grad_ops, reuses_kept=g.reuses_kept, reuses_fresh=g.reuses_fresh,
                 decided_by=g.decided_by, measured_speedup=g.measured_speedup)
            for backend in step.backends.values() for g in backend.graphs]


def compile_phases_s(top: int = 8) -> dict[str, float]:
    """The ``top`` longest compile phases torch timed in this process (nested phases overlap)."""
    from concur import _torch_compat as compat

    phases = sorted(compat.compile_phase_seconds().items(), key=lambda kv: -kv[1])[:top]
    return {name: round(seconds, 2) for name, seconds in phases}


def run_one(cfg: dict) -> dict:
    """Measure one configuration in this process; return its result row (errors are rows too)."""
    import torch

    row = _start_row(cfg)
    cuda = torch.cuda.is_available()
    status = _check_runnable(cfg, cuda)
    if status:
        return dict(row, status=status)
    model, x, y, amp_dtype = model_and_batch(cfg, "cuda" if cuda else "cpu")
    if cfg["mode"] == "critical_path":
        return _critical_path_row(row, cfg, model, x, amp_dtype)
    turn = GpuTurn(cfg.get("gpu_lock"))
    turn.shared()  # with --compile-jobs N: compile and capture beside other children, time alone
    prepared = prepare_mode(cfg, row, model, x, y, amp_dtype, turn)
    turn.exclusive()  # no other child's compile or capture runs kernels beside the timed steps
    prepared.memory.begin_steps()
    time_steps(row, cfg, prepared.step_fn, cuda)
    prepared.memory.end_steps()
    prepared.memory.record_steady(row)
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
            if mode_kind(cfg["mode"]) in COMPILING_MODES:
                if first_compile is not None:
                    row["compile_cache"] = f"warm: compiled after {first_compile} in the same process"
                first_compile = first_compile or cfg["mode"]
            model, x, y, amp_dtype = model_and_batch(cfg, "cuda" if cuda else "cpu")
            if cfg["mode"] == "critical_path":
                rows[-1] = _critical_path_row(row, cfg, model, x, amp_dtype)
                continue
            prepared.append(prepare_mode(cfg, row, model, x, y, amp_dtype, turn))
        except Exception as exc:  # noqa: BLE001 - a failing mode is a result; the others still run
            row.update(error_fields(exc))
    turn.exclusive()
    time_in_turns(prepared, cfgs[0])
    turn.release()
    for p in prepared:
        _describe_keeping_the_timing(p)
    return rows


def _root_cause(exc: BaseException) -> BaseException:
    """The first exception of a chain: fx's ShapeProp, for one, wraps an out-of-memory in its own RuntimeError."""
    seen = {id(exc)}
    while (earlier := exc.__cause__ or exc.__context__) is not None and id(earlier) not in seen:
        exc = earlier
        seen.add(id(exc))
    return exc


def error_fields(exc: Exception) -> dict:
    """Return what a row records of the exception being handled: a failing mode is a result.

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
        p.row["describe_error"] = error_fields(exc)["error"]
        return p.row


def _row_or_error(cfg: dict) -> dict:
    started = time.time()
    try:
        row = run_one(cfg)
    except Exception as exc:  # a failing mode is a result
        row = dict(cfg, key=config_key(cfg), started=started, **error_fields(exc))
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
            rows = [dict(c, key=config_key(c), started=time.time(), **error_fields(exc)) for c in cfgs]
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

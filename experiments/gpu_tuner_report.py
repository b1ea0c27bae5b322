"""Issue 4 on the GPU: the measured tuner against a full sweep of fixed stream counts, with a report.

    PYTHONPATH=. python experiments/gpu_tuner_report.py --out "$OUT"
    PYTHONPATH=. python experiments/gpu_tuner_report.py --out /tmp/x --cases googlenet:8 --sweep 1 4   # quick

For each case (GoogLeNet 224x224 and Inception-v3 299x299 at batch 8 and 64,
fp32, SGD with momentum, cross entropy), in one process:

1. eager loop, serial CUDA graph and fixed stream counts (default 1 2 3 4 6 8,
   critical-path scheduler), each a deep copy of one model, timed with CUDA
   events (median and IQR of 20 steps), peak memory beside it;
2. the tuner (``concur.observe.tuner.tune_train_step``, what ``streams="auto"`` runs)
   with a fresh cache under OUT; its choice re-timed like the sweep, and the
   verdict: within 5% of the best fixed count? Then a second call, which
   must come from the cache;
3. NVML samples of 2 s each of eager, serial graph and the chosen
   configuration (phases of one monitor record);
4. after every case is timed (so the profiler cannot disturb a timing), a
   torch.profiler trace of 3 steps of the serial graph and of the chosen
   configuration; if graph replays hide their kernels from the profiler, the
   same plan is profiled without the graph, and the report says so.

Writes OUT/run/ (run.json, monitor/, traces/), OUT/gpu_tuner_results.json and
the report OUT/run/report/index.html. A failing configuration is recorded,
not fatal. Meant to finish in about 5 minutes on an H100 (limit 8).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torchvision

import concur
from concur.observe.monitor import Monitor, driver_version
from concur.observe.profile_trace import parse_trace, profile_steps
from concur.observe.report import write_report
from concur.observe.rundir import Case, RunWriter, Variant
from concur.observe.timing import time_cuda_ms, time_wall_ms
from concur.observe.tuner import Config, tune_train_step

MODELS = {
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False), 224),
    "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False),
                     299),
}
SMOKE_SIZE = {"googlenet": 32, "inception_v3": 75}
DEFAULT_CASES = ["googlenet:8", "googlenet:64", "inception_v3:8", "inception_v3:64"]
WITHIN = 1.05


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


class Device:
    """CUDA normally; ``--cpu-smoke`` runs the same plumbing on CPU (tiny images, wall-clock timer)."""

    name = "cuda"

    @classmethod
    def on_cuda(cls) -> bool:
        return cls.name == "cuda"

    @classmethod
    def sync(cls) -> None:
        if cls.on_cuda():
            torch.cuda.synchronize()

    @classmethod
    def time_ms(cls, fn: Callable[[], Any], warmup: int, repeats: int) -> tuple[float, float]:
        timer = time_cuda_ms if cls.on_cuda() else time_wall_ms
        return timer(fn, warmup=warmup, repeats=repeats)

    @classmethod
    def reset_peak(cls) -> float:
        if not cls.on_cuda():
            return 0.0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    @classmethod
    def peak_mb(cls, before: float) -> float | None:
        return (torch.cuda.max_memory_allocated() - before) / 2**20 if cls.on_cuda() else None


def _free() -> None:
    gc.collect()
    Device.sync()
    if Device.on_cuda():
        torch.cuda.empty_cache()


class CaseRunner:
    """Measures one (model, batch) case into a :class:`Case`; keeps the steps needed for monitoring."""

    def __init__(self, case: Case, model_name: str, batch: int, repeats: int):
        make, size = MODELS[model_name]
        torch.manual_seed(0)
        self.case, self.repeats = case, repeats
        size = size if Device.on_cuda() else SMOKE_SIZE[model_name]
        self.base = make().to(Device.name).train()
        self.x = torch.randn(batch, 3, size, size, device=Device.name)
        self.y = torch.randint(0, 1000, (batch,), device=Device.name)
        self.loss_fn = nn.CrossEntropyLoss()

    def copy(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(self.base)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def eager_fn(self) -> Callable[[], Any]:
        model, opt = self.copy()

        def fn() -> None:
            opt.zero_grad(set_to_none=True)
            self.loss_fn(model(self.x), self.y).backward()
            opt.step()
        return fn

    def concur_fn(self, config: Config) -> Callable[[], Any]:
        model, opt = self.copy()
        step = concur.train_step(model, self.loss_fn, opt, (self.x, self.y), streams=config.streams,
                                 cuda_graph=config.cuda_graph, scheduler=config.scheduler)
        step(self.x, self.y)  # capture
        graphs = list(getattr(step, "graphs", {}).values())
        if Device.on_cuda() and config.cuda_graph and (not graphs or getattr(graphs[0], "streams", config.streams) != config.streams):
            raise RuntimeError(f"capture fell back (got {getattr(graphs[0], 'streams', '?') if graphs else 'eager'})")
        return lambda: step(self.x, self.y)

    def measure(self, label: str, role: str, config: Config | None) -> tuple[Variant, Callable | None]:
        """Time one variant; return it and its step function (None when it failed)."""
        _free()
        before = Device.reset_peak()
        v = Variant(label, None if config is None else config.streams, None if config is None else config.scheduler,
                    config is not None and config.cuda_graph, role=role)
        try:
            fn = self.eager_fn() if config is None else self.concur_fn(config)
            v.median_ms, v.iqr_ms = Device.time_ms(fn, 5, self.repeats)
            v.repeats = self.repeats
            v.peak_mb = Device.peak_mb(before)
        except Exception as exc:  # one failing configuration is a result, not the end of the run
            v.error, fn = _error(exc), None
            print(f"    {label}: FAILED {v.error}", flush=True)
        else:
            print(f"    {label:34s} {v.median_ms:8.2f} ms (iqr {v.iqr_ms:.2f})  peak {v.peak_mb} MB", flush=True)
        self.case.variants.append(v)
        return v, fn


def monitor_overhead(runner: CaseRunner, repeats: int) -> dict:
    """Eager step time with and without the NVML sampler running (eager is the CPU-bound, sensitive case)."""
    fn = runner.eager_fn()
    without, with_ = [], []
    cpu = []
    for _ in range(2):  # interleaved, so drift hits both alike
        without.append(Device.time_ms(fn, 3, repeats)[0])
        with Monitor() as mon:
            with_.append(Device.time_ms(fn, 3, repeats)[0])
        cpu.append(100 * mon.record.overhead_fraction)
    a, b = sum(without) / 2, sum(with_) / 2
    return dict(eager_ms_without=a, eager_ms_with=b, slowdown_percent=100 * (b / a - 1),
                sampler_cpu_percent=sum(cpu) / len(cpu), nvml_available=mon.available)


def run_case(writer: RunWriter, spec: str, sweep: list[int], args: argparse.Namespace,
             meta: dict) -> tuple[Case, dict[str, Any]]:
    """Time the sweep, run the tuner, re-time its choice, sample NVML; return the case and a result row."""
    model_name, batch = spec.split(":")[0], int(spec.split(":")[1])
    case = writer.case(f"{model_name} b{batch}", model=model_name, batch=batch)
    print(f"\n== {case.name}", flush=True)
    runner = CaseRunner(case, model_name, batch, args.repeats)
    keep: dict[str, Callable] = {}
    if "monitor_overhead" not in meta:
        meta["monitor_overhead"] = monitor_overhead(runner, args.repeats)
        print(f"    NVML sampler overhead: {meta['monitor_overhead']}", flush=True)
    _, fn = runner.measure("eager", "eager", None)
    if fn:
        keep["eager"] = fn
    for k in sweep:
        label = "serial graph" if k == 1 else f"{k} streams"
        _, fn = runner.measure(label, "serial" if k == 1 else "sweep", Config(k, "critical_path"))
        if fn and k == 1:
            keep["serial graph"] = fn
        writer.save()
    fixed = [v for v in case.variants if v.role in ("serial", "sweep") and v.median_ms is not None]
    best = min(fixed, key=lambda v: v.median_ms) if fixed else None

    # The tuner, on its own copy, with a fresh cache.
    cache_dir = Path(args.out) / "tuner_cache"
    model, opt = runner.copy()
    result = {"case": case.name}
    try:
        _free()
        timer = None if Device.on_cuda() else Device.time_ms  # CPU smoke only: CUDA events otherwise
        tuned = tune_train_step(model, runner.loss_fn, opt, (runner.x, runner.y), make_step=concur.train_step,
                                budget_s=args.budget_s,
                                cache_dir=cache_dir, progress=True, timer=timer)
        case.tuner = tuned.to_dict()
        t0 = time.monotonic()
        again = tune_train_step(model, runner.loss_fn, opt, (runner.x, runner.y), make_step=concur.train_step,
                                budget_s=args.budget_s,
                                cache_dir=cache_dir, progress=False, timer=timer)
        result.update(tuner_s=tuned.seconds, cache_hit=again.from_cache and again.config == tuned.config,
                      cache_hit_s=time.monotonic() - t0, stopped=tuned.stopped, lever=tuned.lever,
                      eager_utilization=tuned.eager_utilization, chosen=tuned.config.label,
                      tuner_ms=tuned.measurement.median_ms if tuned.measurement else None)
        print(f"    tuner chose {tuned.config.label} in {tuned.seconds:.1f} s ({tuned.stopped}); "
              f"lever {tuned.lever}, eager utilization {tuned.eager_utilization}", flush=True)
        del model, opt
        v, fn = runner.measure(f"tuner: {tuned.config.label}", "tuned", tuned.config)
        if fn:
            keep["tuner's choice"] = fn
        config = tuned.config
    except Exception as exc:
        case.notes.append(f"tuner failed: {_error(exc)}")
        traceback.print_exc()
        v, config = None, None
    if best is not None and v is not None and v.median_ms is not None:
        ratio = v.median_ms / best.median_ms
        result.update(best_fixed=best.label, best_fixed_ms=best.median_ms, chosen_ms=v.median_ms,
                      chosen_vs_best=ratio, within_5pct=ratio <= WITHIN)
        print(f"    verdict: chosen {v.median_ms:.2f} ms vs best fixed {best.label} {best.median_ms:.2f} ms "
              f"-> {ratio:.3f} ({'within' if ratio <= WITHIN else 'NOT within'} 5%)", flush=True)

    # NVML: 2 s of each kept step function, one phase each.
    with Monitor(interval_s=0.05) as mon:
        for label, fn in keep.items():
            mon.mark(label)
            end = time.monotonic() + args.phase_s
            while time.monotonic() < end:
                fn()
            Device.sync()
    mon.record.save(writer.monitor_path(case))
    keep.clear()
    del runner.base
    _free()
    writer.save()
    result["profile_config"] = None if config is None else [config.streams, config.scheduler, config.cuda_graph]
    return case, result


def profile_case(writer: RunWriter, case: Case, spec: str, config: Config | None) -> None:
    """Trace 3 steps of the serial graph and of the chosen configuration (eagerly if replays hide kernels)."""
    model_name, batch = spec.split(":")[0], int(spec.split(":")[1])
    runner = CaseRunner(case, model_name, batch, 0)
    configs = [("serial graph", Config(1))]
    if config is not None and config != Config(1):
        configs.append((f"concur {config.streams} streams", config))
    for label, cfg in configs:
        try:
            path = writer.trace_path(case, label)
            profile_steps(runner.concur_fn(cfg), path, active=3, warmup=2)
            if not parse_trace(path).kernels and cfg.cuda_graph:
                mode = "eager (graph replays hidden from the profiler)"
                path = writer.trace_path(case, label, mode=mode)
                profile_steps(runner.concur_fn(Config(cfg.streams, cfg.scheduler, cuda_graph=False)), path,
                              active=3, warmup=2)
                case.notes.append(f"{label}: this torch's profiler shows no kernels inside CUDA graph replays, "
                                  "so the same plan was profiled without the graph")
            print(f"    trace {label}: {path.name} {path.stat().st_size / 1e6:.1f} MB", flush=True)
        except Exception as exc:
            case.notes.append(f"profiling {label} failed: {_error(exc)}")
            case.traces = [t for t in case.traces if t.label != label]
        _free()
    del runner
    _free()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/concur_out"))
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="model:batch, e.g. googlenet:8")
    parser.add_argument("--sweep", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=20.0)
    parser.add_argument("--phase-s", type=float, default=2.0, help="seconds of NVML sampling per phase")
    parser.add_argument("--cases-deadline-s", type=float, default=330.0, help="start no new case past this")
    parser.add_argument("--deadline-s", type=float, default=400.0, help="start no profiling past this")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="check the plumbing on CPU (tiny images, no graphs, wall-clock times): not a result")
    args = parser.parse_args(argv)
    Device.name = "cpu" if args.cpu_smoke else "cuda"
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_tuner_report needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    start = time.monotonic()
    if 1 not in args.sweep:
        args.sweep = [1] + args.sweep  # the serial graph is the baseline of every ratio
    gpu = torch.cuda.get_device_name() if Device.on_cuda() else "cpu (smoke run: not a result)"
    meta = dict(date=datetime.date.today().isoformat(), gpu=gpu, torch=torch.__version__,
                cuda=torch.version.cuda, concur=concur.__version__, driver=driver_version(),
                timing=f"CUDA events, median and IQR of {args.repeats} steps after 5 warm-up steps")
    print(f"{meta['date']}  {meta['gpu']}  torch {meta['torch']}  driver {meta['driver']}", flush=True)
    out = Path(args.out)
    writer = RunWriter(out / "run", meta)
    done: list[tuple[str, Case | None, dict]] = []
    for spec in args.cases:
        if time.monotonic() - start > args.cases_deadline_s:
            done.append((spec, None, dict(case=spec, error="skipped: the run's deadline for new cases passed")))
            continue
        try:
            done.append((spec, *run_case(writer, spec, args.sweep, args, writer.run.meta)))
        except Exception as exc:  # e.g. out of memory building the model: record and go on
            traceback.print_exc()
            done.append((spec, None, dict(case=spec, error=_error(exc))))
            _free()
        writer.save()
    _write_results(out, writer, done, start)  # before profiling: a profiler crash must not lose the timings
    for spec, case, res in done:
        if case is None:
            continue
        if time.monotonic() - start > args.deadline_s:
            case.notes.append("not profiled: the run's deadline was reached")
            continue
        cfg = res.get("profile_config")
        profile_case(writer, case, spec, Config(*cfg) if cfg else None)
        writer.save()
    summary = _write_results(out, writer, done, start)
    results = summary["results"]
    try:
        html = write_report(out / "run")
        print(f"\nreport: {html}")
    except Exception as exc:
        traceback.print_exc()
        print(f"report failed: {_error(exc)}")
    print("\n| case | best fixed | ms | tuner's choice | ms | chosen/best | within 5% | tuning s | cache hit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {r.get('best_fixed')} | {_f(r.get('best_fixed_ms'))} | {r.get('chosen')} | "
              f"{_f(r.get('chosen_ms'))} | {_f(r.get('chosen_vs_best'), 3)} | {r.get('within_5pct')} | "
              f"{_f(r.get('tuner_s'), 1)} | {r.get('cache_hit')} |")
    print(f"total {summary['seconds']:.0f} s; all within 5%: {summary['all_within_5pct']}")
    return 0


def _write_results(out: Path, writer: RunWriter, done: list, start: float) -> dict:
    results = [res for _, _, res in done]
    summary = dict(meta=writer.run.meta, results=results, seconds=time.monotonic() - start,
                   all_within_5pct=bool(results) and all(r.get("within_5pct") is True for r in results))
    (out / "gpu_tuner_results.json").write_text(json.dumps(summary, indent=1))
    return summary


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())

"""``concur report RUN_DIR``: one self-contained HTML page, PNG plots and the same numbers as JSON.

The page answers, per case (model, batch): which lever paid (eager
utilization: launch-bound or not), how fast each stream count ran (median
and spread, peak memory), what the tuner chose against the best fixed count
of the same run, and whether kernels really overlapped (summed kernel time
over wall time per step, from the profiler trace, with a per-stream Gantt
chart). Every number shown in the HTML is taken from ``report.json``, which
is written first; the Chrome traces are copied beside it for Perfetto.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from concur.observe.monitor import MonitorRecord
from concur.observe.profile_trace import TraceSummary, parse_trace
from concur.observe.rundir import Case, Run, load_run, slug

__all__ = ["case_data", "report_data", "render_html", "write_report"]

WITHIN = 1.05  # the tuner's choice counts as good when within 5% of the best fixed stream count


# ---------------------------------------------------------------------------------------------------------
# numbers

def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def case_data(case: Case, run_dir: Path) -> dict:
    """Return the report's numbers for one case (variants, tuner, NVML phases, overlap)."""
    ok = [v for v in case.variants if v.error is None and v.median_ms is not None]
    eager = next((v for v in ok if v.role == "eager"), None)
    serial = next((v for v in ok if v.role == "serial"), None)
    fixed = [v for v in ok if v.role in ("serial", "sweep")]
    best = min(fixed, key=lambda v: v.median_ms) if fixed else None
    tuned = next((v for v in ok if v.role == "tuned"), None)
    variants = [dict(label=v.label, role=v.role, streams=v.streams, scheduler=v.scheduler, cuda_graph=v.cuda_graph,
                     median_ms=v.median_ms, iqr_ms=v.iqr_ms, peak_mb=v.peak_mb,
                     vs_serial=_ratio(serial.median_ms if serial else None, v.median_ms),
                     vs_eager=_ratio(eager.median_ms if eager else None, v.median_ms), error=v.error)
                for v in case.variants]
    tuner = case.tuner or {}
    tuned_vs_best = _ratio(tuned.median_ms if tuned else None, best.median_ms if best else None)
    summary = dict(case=case.name, eager_ms=eager.median_ms if eager else None,
                   serial_ms=serial.median_ms if serial else None,
                   best_fixed=best.label if best else None, best_fixed_ms=best.median_ms if best else None,
                   best_fixed_vs_serial=_ratio(serial.median_ms if serial else None, best.median_ms if best else None),
                   tuned=tuned.label if tuned else None, tuned_ms=tuned.median_ms if tuned else None,
                   tuned_vs_serial=_ratio(serial.median_ms if serial else None, tuned.median_ms if tuned else None),
                   tuned_vs_best=tuned_vs_best,
                   within_5pct=None if tuned_vs_best is None else tuned_vs_best <= WITHIN,
                   tuner_s=tuner.get("seconds"), lever=tuner.get("lever"),
                   eager_utilization=tuner.get("eager_utilization"))
    trials = [dict(label=_config_label(t["config"]), median_ms=(t["measurement"] or {}).get("median_ms"),
                   iqr_ms=(t["measurement"] or {}).get("iqr_ms"), seconds=t["seconds"], error=t["error"],
                   runs=_runs((t["measurement"] or {}).get("notes", ())))
              for t in tuner.get("trials", [])]
    data = dict(name=case.name, model=case.model, batch=case.batch, summary=summary, variants=variants,
                tuner=dict(chosen=_config_label(tuner["config"]) if tuner else None, stopped=tuner.get("stopped"),
                           from_cache=tuner.get("from_cache"), trials=trials),
                phases=[], monitor=None, overlap=[], notes=list(case.notes))
    if case.monitor and (run_dir / case.monitor).exists():
        record = MonitorRecord.load(run_dir / case.monitor)
        data["monitor"] = dict(available=record.available, reason=record.reason, device=record.device,
                               utilization_source=record.utilization_source, duration_s=record.duration_s,
                               sampler_cpu_percent=100 * record.overhead_fraction)
        data["phases"] = [_phase_data(record, label, s, e) for label, s, e in record.phases()]
    for ref in case.traces:
        summary_ = _parsed(run_dir / ref.path)
        m = summary_.to_dict()["mean"]
        data["overlap"].append(dict(label=ref.label, mode=ref.mode, path=ref.path, steps=len(summary_.steps),
                                    streams=len(summary_.streams), kernels=m["kernels"],
                                    kernel_ms=_scale(m["kernel_us"]), busy_ms=_scale(m["busy_us"]),
                                    wall_ms=_scale(m["wall_us"]), overlap=m["overlap"],
                                    concurrency=m["concurrency"], kernels_hidden=summary_.kernels_hidden))
    return data


@functools.lru_cache(maxsize=32)
def _parsed_cached(path: str, mtime_ns: int, size: int) -> TraceSummary:
    return parse_trace(path)


def _parsed(path: Path) -> TraceSummary:
    """Parse a trace once per report (the numbers and the Gantt chart both need it)."""
    st = path.stat()
    return _parsed_cached(str(path), st.st_mtime_ns, st.st_size)


def _runs(notes: Any) -> str | None:
    """How a trial's step ran (``TrainStep.status``, which the tuner notes as "runs ..."), where it says."""
    return next((n[len("runs "):] for n in notes if isinstance(n, str) and n.startswith("runs ")), None)


def _scale(us: float | None) -> float | None:
    return None if us is None else us / 1000.0


def _config_label(c: dict) -> str:
    return f"{c['streams']} stream{'s' if c['streams'] != 1 else ''}, {c['scheduler']}" + \
        ("" if c.get("cuda_graph", True) else ", eager")


def _phase_data(record: MonitorRecord, label: str, start: float, end: float) -> dict:
    inside = [s for s in record.samples if start <= s.t_s < end]
    pick = lambda attr: [getattr(s, attr) for s in inside if getattr(s, attr) is not None]  # noqa: E731
    return dict(label=label, seconds=end - start, utilization=record.mean_utilization(start, end),
                utilization_samples=sum(start <= u.t_s < end for u in record.utilization),
                sm_clock_mhz=_mean(pick("sm_clock_mhz")), power_w=_mean(pick("power_w")),
                memory_used_mb=max(pick("memory_used_mb"), default=None))


def report_data(run: Run, run_dir: str | os.PathLike) -> dict:
    """Return everything the report shows, as a JSON-ready dict."""
    cases = [case_data(c, Path(run_dir)) for c in run.cases]
    return dict(meta=run.meta, summary=[c["summary"] for c in cases], cases=cases)


# ---------------------------------------------------------------------------------------------------------
# plots (matplotlib's object API: no pyplot, so no global backend or state is touched)

ROLE_COLORS = {"eager": "#999999", "serial": "#4c72b0", "sweep": "#55a868", "tuned": "#c44e52"}


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def plot_step_times(case: dict, path: Path) -> Path | None:
    """Bar chart of median step time per variant with its interquartile range."""
    rows = [v for v in case["variants"] if v["median_ms"] is not None and v["error"] is None]
    if not rows:
        return None
    fig = _figure(7, 0.35 * len(rows) + 1.2)
    ax = fig.add_subplot()
    y = range(len(rows))
    ax.barh(list(y), [v["median_ms"] for v in rows], xerr=[(v["iqr_ms"] or 0) / 2 for v in rows],
            color=[ROLE_COLORS.get(v["role"], "#8172b2") for v in rows], capsize=3)
    ax.set_yticks(list(y), [v["label"] for v in rows])
    ax.invert_yaxis()
    ax.set_xlabel("training step, ms (median; bar = IQR)")
    ax.set_title(f"{case['name']}: step time")
    return _save(fig, path)


def plot_utilization(record: MonitorRecord, title: str, path: Path) -> Path | None:
    """GPU utilization, SM clock and memory over time, one line per phase, from each phase's start."""
    if not record.available or not record.samples:
        return None
    fig = _figure(8, 6)
    axes = fig.subplots(3, 1, sharex=True)
    phases = record.phases() or [("run", 0.0, record.duration_s)]
    for i, (label, start, end) in enumerate(phases):
        color = f"C{i % 10}"  # one colour per phase in every panel, whichever panels have its samples
        util = [(u.t_s - start, u.gpu_percent) for u in record.utilization if start <= u.t_s < end]
        if util:
            axes[0].step(*zip(*util), where="post", label=label, color=color)
        for ax, attr in ((axes[1], "sm_clock_mhz"), (axes[2], "memory_used_mb")):
            pts = [(s.t_s - start, getattr(s, attr)) for s in record.samples
                   if start <= s.t_s < end and getattr(s, attr) is not None]
            if pts:
                ax.plot(*zip(*pts), label=label, color=color)
    axes[0].set_ylabel("GPU util %")
    axes[0].set_ylim(0, 105)
    axes[1].set_ylabel("SM clock MHz")
    axes[2].set_ylabel("device memory\nused MB (NVML)")
    axes[2].set_xlabel("seconds since the phase started")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[0].set_title(f"{title}: NVML ({record.utilization_source} utilization, {record.device})")
    return _save(fig, path)


def _gantt_step(summary: TraceSummary) -> int | None:
    """The step to draw: the median one by wall time (first and last steps are often atypical)."""
    if not summary.steps:
        return None
    ordered = sorted(summary.steps, key=lambda s: s.wall_us)
    return ordered[len(ordered) // 2].step


def plot_gantt(traces: list[tuple[str, TraceSummary]], title: str, path: Path) -> Path | None:
    """Per-stream Gantt chart of one step's kernels for each trace (e.g. serial and concurrent)."""
    drawable = [(label, s, _gantt_step(s)) for label, s in traces if s.kernels and _gantt_step(s) is not None]
    if not drawable:
        return None
    fig = _figure(10, sum(0.45 * len(s.streams) + 1.0 for _, s, _ in drawable))
    axes = fig.subplots(len(drawable), 1, squeeze=False)[:, 0]
    for ax, (label, summary, step) in zip(axes, drawable):
        ks = [k for k in summary.kernels if k.step == step]
        t0 = min(k.start_us for k in ks)
        streams = sorted({k.stream for k in ks})
        for row, stream in enumerate(streams):
            bars = [((k.start_us - t0) / 1000, k.dur_us / 1000) for k in ks if k.stream == stream]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=f"C{row % 10}")
        ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
        ax.invert_yaxis()
        ov = next(s for s in summary.steps if s.step == step)
        ax.set_title(f"{label}: step {step}, {len(ks)} kernels, kernel time / wall time = {ov.overlap:.2f}",
                     fontsize=9)
    axes[-1].set_xlabel("ms since the step's first kernel")
    fig.suptitle(title)
    return _save(fig, path)


def plot_summary(data: dict, path: Path) -> Path | None:
    """Speedup over the serial graph per case: best fixed stream count vs the tuner's choice."""
    rows = [s for s in data["summary"] if s["best_fixed_vs_serial"] is not None]
    if not rows:
        return None
    fig = _figure(1.6 * len(rows) + 2, 3.5)
    ax = fig.add_subplot()
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [s["best_fixed_vs_serial"] for s in rows], 0.4, label="best fixed",
           color=ROLE_COLORS["sweep"])
    ax.bar([i + 0.2 for i in x], [s["tuned_vs_serial"] or 0 for s in rows], 0.4, label="tuner",
           color=ROLE_COLORS["tuned"])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, [s["case"] for s in rows])
    ax.set_ylabel("speedup vs serial CUDA graph")
    ax.legend()
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# HTML

def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "ms":
        return f"{value:.2f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "pct":
        return f"{value:.1f}%"
    if kind == "int":
        return f"{value:.0f}"
    if kind == "f2":
        return f"{value:.2f}"
    if kind == "bool":
        return "yes" if value else "NO"
    return html.escape(str(value))


def _table(rows: list[dict], columns: list[tuple[str, str, str]], prefix: str) -> str:
    """An HTML table; each cell carries ``data-key`` = the JSON path of the number it shows."""
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title, _ in columns)
    body = []
    for i, row in enumerate(rows):
        cells = "".join(f'<td data-key="{prefix}.{i}.{key}">{_fmt(row.get(key), kind)}</td>'
                        for key, _, kind in columns)
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _img(path: Path | None, alt: str) -> str:
    if path is None:
        return f"<p class=note>(no data for: {html.escape(alt)})</p>"
    encoded = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" title="{html.escape(path.name)}" src="data:image/png;base64,{encoded}">'


SUMMARY_COLUMNS = [("case", "case", "s"), ("eager_ms", "eager ms", "ms"), ("serial_ms", "serial graph ms", "ms"),
                   ("best_fixed", "best fixed", "s"), ("best_fixed_ms", "best fixed ms", "ms"),
                   ("best_fixed_vs_serial", "best vs serial", "x"), ("tuned", "tuner's choice", "s"),
                   ("tuned_ms", "chosen ms", "ms"), ("tuned_vs_serial", "chosen vs serial", "x"),
                   ("tuned_vs_best", "chosen / best", "f2"), ("within_5pct", "within 5%", "bool"),
                   ("tuner_s", "tuning s", "f2"), ("eager_utilization", "eager GPU util", "pct"),
                   ("lever", "lever", "s")]
VARIANT_COLUMNS = [("label", "variant", "s"), ("streams", "streams", "int"), ("scheduler", "scheduler", "s"),
                   ("median_ms", "median ms", "ms"), ("iqr_ms", "IQR ms", "ms"), ("vs_serial", "vs serial graph", "x"),
                   ("vs_eager", "vs eager", "x"), ("peak_mb", "peak MB", "int"), ("error", "error", "s")]
TRIAL_COLUMNS = [("label", "trial", "s"), ("median_ms", "median ms", "ms"), ("iqr_ms", "IQR ms", "ms"),
                 ("seconds", "seconds", "f2"), ("runs", "runs", "s"), ("error", "error", "s")]
PHASE_COLUMNS = [("label", "phase", "s"), ("seconds", "seconds", "f2"), ("utilization", "GPU util", "pct"),
                 ("utilization_samples", "util samples", "int"), ("sm_clock_mhz", "SM clock MHz", "int"),
                 ("power_w", "power W", "int"), ("memory_used_mb", "memory used MB", "int")]
OVERLAP_COLUMNS = [("label", "trace", "s"), ("mode", "profiled as", "s"), ("steps", "steps", "int"),
                   ("streams", "streams", "int"), ("kernels", "kernels/step", "int"),
                   ("kernel_ms", "kernel time ms", "ms"), ("busy_ms", "GPU busy ms", "ms"),
                   ("wall_ms", "wall ms", "ms"), ("overlap", "kernel/wall", "f2"),
                   ("concurrency", "kernel/busy", "f2")]

STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child{text-align:left}img{max-width:100%;display:block;margin:.5em 0}
.note{color:#666;font-size:.9em}"""


def render_html(data: dict, images: dict[str, Path | None]) -> str:
    """Return the report page; PNGs are embedded, so the one file is the whole report."""
    meta = data["meta"]
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>concur report</title>"
             f"<style>{STYLE}</style></head><body><h1>concur report</h1>",
             "<p>" + ", ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items()) + "</p>",
             "<h2>Summary</h2>", _table(data["summary"], SUMMARY_COLUMNS, "summary"),
             "<p class=note>best fixed = fastest of the fixed stream counts of this run (serial graph "
             "included); within 5% compares the tuner's choice, re-timed like the sweep, with it. Lever: "
             "'capture' when the eager loop left the GPU idle (launch-bound), 'streams' when it kept it busy."
             "</p>", _img(images.get("summary"), "speedup summary")]
    for i, case in enumerate(data["cases"]):
        p = f"cases.{i}"
        parts += [f"<h2>{html.escape(case['name'])}</h2>", "<h3>Step time</h3>",
                  _table(case["variants"], VARIANT_COLUMNS, f"{p}.variants"),
                  _img(images.get(f"{p}.steptime"), "step times")]
        if case["tuner"]["trials"] or case["tuner"]["chosen"]:
            t = case["tuner"]
            parts += ["<h3>Tuner</h3>",
                      f"<p>chose <b>{html.escape(str(t['chosen']))}</b>; stopped: {html.escape(str(t['stopped']))}"
                      f"{' (from cache)' if t['from_cache'] else ''}</p>",
                      _table(t["trials"], TRIAL_COLUMNS, f"{p}.tuner.trials")]
        parts.append("<h3>GPU utilization (NVML)</h3>")
        mon = case["monitor"]
        if mon is None:
            parts.append("<p class=note>no NVML record for this case</p>")
        elif not mon["available"]:
            parts.append(f"<p class=note>NVML unavailable: {html.escape(mon['reason'])}</p>")
        else:
            parts += [_table(case["phases"], PHASE_COLUMNS, f"{p}.phases"),
                      f'<p class=note>sampler thread CPU time: <span data-key="{p}.monitor.sampler_cpu_percent">'
                      f"{_fmt(mon['sampler_cpu_percent'], 'pct')}</span> of one core</p>",
                      _img(images.get(f"{p}.utilization"), "utilization")]
        parts.append("<h3>Kernel overlap (torch.profiler)</h3>")
        if case["overlap"]:
            parts.append(_table(case["overlap"], OVERLAP_COLUMNS, f"{p}.overlap"))
            for o in case["overlap"]:
                parts.append(f'<p class=note>trace <a href="{html.escape(o["path"])}">{html.escape(o["path"])}</a> '
                             "(open in https://ui.perfetto.dev)"
                             + (": graph replays hid their kernels from the profiler" if o["kernels_hidden"] else "")
                             + "</p>")
            parts.append(_img(images.get(f"{p}.gantt"), "per-stream kernels"))
        else:
            parts.append("<p class=note>no profiler trace for this case</p>")
        parts += [f"<p class=note>{html.escape(n)}</p>" for n in case["notes"]]
    parts.append("</body></html>")
    return "\n".join(parts)


def _plot(fn: Any, *args: Any) -> Path | None:
    """Run a plot function; without matplotlib warn once and leave the plot out (the numbers stay)."""
    try:
        return fn(*args)
    except ImportError:
        if not _plot.warned:
            _plot.warned = True
            warnings.warn("concur report: matplotlib is not installed (pip install 'concur[report]'); "
                          "the report has its tables and JSON but no plots.", RuntimeWarning, stacklevel=3)
        return None


_plot.warned = False


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``index.html``, ``report.json``, PNG plots and copies of the traces; return the HTML path."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    run = load_run(run_dir)
    data = report_data(run, run_dir)
    (out / "report.json").write_text(json.dumps(data, indent=1))
    images: dict[str, Path | None] = {"summary": _plot(plot_summary, data, out / "summary_speedup.png")}
    for i, (case, cd) in enumerate(zip(run.cases, data["cases"])):
        name = slug(case.name)
        images[f"cases.{i}.steptime"] = _plot(plot_step_times, cd, out / f"{name}_steptime.png")
        if case.monitor and (run_dir / case.monitor).exists():
            images[f"cases.{i}.utilization"] = _plot(plot_utilization, MonitorRecord.load(run_dir / case.monitor),
                                                     case.name, out / f"{name}_utilization.png")
        traces = []
        for ref in case.traces:
            src = run_dir / ref.path
            (out / ref.path).parent.mkdir(parents=True, exist_ok=True)
            if src.resolve() != (out / ref.path).resolve():
                shutil.copyfile(src, out / ref.path)
            traces.append((f"{ref.label} ({ref.mode})", _parsed(src)))
        if traces:
            images[f"cases.{i}.gantt"] = _plot(plot_gantt, traces, case.name, out / f"{name}_gantt.png")
    html_path = out / "index.html"
    html_path.write_text(render_html(data, images))
    return html_path

"""The reports of a run: summary.md with its tables, and the PNG plots (the rows stay in results.jsonl).

Every file names the run's date, GPU, driver and torch version (in its
title, or in the PNG's metadata), so a figure read on its own says where it
was measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.sweep.configs import (ALL_MODES, CONCUR_MODES, CONCUR_ONE_STREAM_MODES, PEER_MODES, PEER_OF,
                                       file_stem, mode_kind)

# (row field, column header) of the memory peaks the peer table divides; peak_mb stands in for the
# setup's allocated peak in rows made before the others were recorded
MEMORY_COLUMNS = (("setup_peak_allocated_mb", "setup alloc"), ("setup_peak_reserved_mb", "setup reserved"),
                  ("steady_peak_allocated_mb", "steady alloc"), ("steady_peak_reserved_mb", "steady reserved"))


def meta_line(meta: dict) -> str:
    """Return the run's date, GPU, driver and torch on one line: the title of every table and plot."""
    return f"{meta['date']}, {meta['gpu']}, driver {meta['driver']}, torch {meta['torch']}"


def memory_mb(row: dict, field: str) -> float | None:
    """Return one of a row's memory peaks (MB); ``peak_mb`` for the setup's allocated one in older rows."""
    value = row.get(field)
    if value is None and field == "setup_peak_allocated_mb":
        value = row.get("peak_mb")
    return value


def _ok_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The timed rows that ran, per (model, precision, batch)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("ms"):
            groups.setdefault((r["model"], r["precision"], r["batch"]), []).append(r)
    return groups


def best_speedups(rows: list[dict]) -> list[dict]:
    """Per (model, precision, batch): best concur mode time, best alternative, and their ratio.

    Where the run has a peer row (PyTorch's recipe, experiments/peers.py) for
    the point, concur's own one-stream steps (serial_graph, compile_graph) are
    no alternative: the alternatives are what a user has without concur.
    """
    out = []
    for (model, precision, batch), rs in sorted(_ok_groups(rows).items()):
        ours = [r for r in rs if mode_kind(r["mode"]) in CONCUR_MODES]
        has_peer = any(r["mode"] in PEER_MODES for r in rs)
        alts = [r for r in rs if mode_kind(r["mode"]) not in CONCUR_MODES
                and not (has_peer and r["mode"] in CONCUR_ONE_STREAM_MODES)]
        if ours and alts:
            o, a = min(ours, key=lambda r: r["ms"]), min(alts, key=lambda r: r["ms"])
            out.append(dict(model=model, precision=precision, batch=batch, concur_mode=o["mode"], concur_ms=o["ms"],
                            best_alternative=a["mode"], alternative_ms=a["ms"], speedup=a["ms"] / o["ms"]))
    return out


def peer_ratios(rows: list[dict]) -> list[dict]:
    """Per row with a peer (``PEER_OF``) that ran at its point: the peer's step time over its, and memory ratios.

    ``speedup`` above 1: the mode is faster than PyTorch's recipe. The memory
    ratios (``<field>_ratio``, for each of ``MEMORY_COLUMNS``) and ``setup_ratio``
    are the mode's over the peer's: below 1, it needs less; no setup ratio where
    either compiled with the caches of an earlier mode of its child. ``together``
    says whether the two were timed in turns in one child (``--together``).
    """
    def warm(r: dict) -> bool:
        return str(r.get("compile_cache", "")).startswith("warm")

    out = []
    for (model, precision, batch), rs in sorted(_ok_groups(rows).items()):
        by_mode = {r["mode"]: r for r in rs}
        for r in sorted(rs, key=lambda r: r["mode"]):
            peer = by_mode.get(PEER_OF.get(mode_kind(r["mode"]), ""))
            if peer is None:
                continue
            entry = dict(model=model, precision=precision, batch=batch, mode=r["mode"], peer=peer["mode"],
                         peer_ms=peer["ms"], ms=r["ms"], speedup=peer["ms"] / r["ms"],
                         synced_speedup=_ratio(peer.get("synced_ms"), r.get("synced_ms")),
                         together=peer["mode"] in (r.get("timed_with") or []),
                         setup_ratio=None if warm(r) or warm(peer) else _ratio(r.get("setup_s"), peer.get("setup_s")))
            for field, _ in MEMORY_COLUMNS:
                entry[field + "_ratio"] = _ratio(memory_mb(r, field), memory_mb(peer, field))
            out.append(entry)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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
    """Write summary.md and the plots; return their paths.

    The rows themselves stay in results.jsonl only: a copy as JSON or CSV
    would double what travels with the tree (experiments/results/README.md).
    """
    written: list[Path] = []
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


def peer_table_markdown(rows: list[dict]) -> list[str]:
    """Each mode against PyTorch's recipe (``peer_ratios``): time, setup and memory ratios side by side."""
    entries = peer_ratios(rows)
    if not entries:
        return []
    num = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = ["", "## Against PyTorch's own recipe (experiments/peers.py)", "",
             "The baseline is the peer: PyTorch's documented step, written without concur. Fused modes and "
             "concur's compiled one-stream step (compile_graph) are divided by peer_compile_graph (torch.compile "
             "+ the docs' whole-network CUDA-graph capture); serial_graph and concur_graph by peer_eager_graph "
             "(the capture alone). Speedup: the peer's step time over the mode's (above 1: faster). Setup and "
             "memory: the mode's over the peer's (below 1: less); no setup ratio where a compile reused the caches "
             "of an earlier mode in its child. Not together: the two were timed in different children. "
             "Synced: the speedup when every step is waited for (a loop that reads its loss each step), "
             "which adds each step's host time before its replay.", "",
             "| model | precision | batch | mode | peer | peer ms | ms | speedup | synced | setup | "
             + " | ".join(header for _, header in MEMORY_COLUMNS) + " |", "|---|---|---|---|---|---|---|---|---|---|"
             + "---|" * len(MEMORY_COLUMNS)]
    for e in entries:
        lines.append(f"| {e['model']} | {e['precision']} | {e['batch']} | {e['mode']} | {e['peer']}"
                     f"{'' if e['together'] else ' (not together)'} | {e['peer_ms']:.2f} | {e['ms']:.2f} | "
                     f"{e['speedup']:.3f}x | {'' if e['synced_speedup'] is None else format(e['synced_speedup'], '.3f') + 'x'} | "
                     f"{num(e['setup_ratio'])} | "
                     + " | ".join(num(e[field + '_ratio']) for field, _ in MEMORY_COLUMNS) + " |")
    return lines


def summary_markdown(rows: list[dict], meta: dict, plots: list[str]) -> str:
    """Return the Markdown summary: every configuration, the speedups, the bounds, the failures."""
    lines = [f"# Sweep: {meta_line(meta)}", "",
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
    lines += ["Peak memory in MB beyond what the process held before the mode's setup, allocated / reserved, "
              "over the setup (build, compile or capture, warm-up) and over the timed steps (steady).", "",
              "| model | precision | batch | mode | status | ms (iqr) | setup s | setup MB | steady MB | util % "
              "| predicted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    num = lambda v, f: "" if v is None else format(v, f)  # noqa: E731

    def pair(r: dict, allocated: str, reserved: str) -> str:
        a, res = memory_mb(r, allocated), memory_mb(r, reserved)
        return "" if a is None and res is None else f"{num(a, '.0f') or '-'} / {num(res, '.0f') or '-'}"
    for r in sorted(rows, key=lambda r: (r["model"], r["precision"], r["batch"], r["mode"])):
        status = r.get("status", "")
        ms = f"{r['ms']:.2f} ({r['iqr_ms']:.2f})" if r.get("ms") else ""
        lines.append(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['mode']} | {status} | {ms} | "
                     f"{num(r.get('setup_s'), '.1f')}{'*' if r.get('compile_jobs') else ''} | "
                     f"{pair(r, 'setup_peak_allocated_mb', 'setup_peak_reserved_mb')} | "
                     f"{pair(r, 'steady_peak_allocated_mb', 'steady_peak_reserved_mb')} | "
                     f"{num(r.get('util_percent'), '.0f')} | {num(r.get('predicted_speedup'), '.2f')} |")
    if any(r.get("compile_jobs") for r in rows):
        lines += ["", "\\* compiled beside other configurations (`--compile-jobs`): not a lone compile time; "
                  "step times were measured alone."]
    lines += peer_table_markdown(rows)
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
        ax.set_title(f"{precision}: {meta_line(meta)}", fontsize=9)
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
    ax.set_title(f"time vs bound: {meta_line(meta)}", fontsize=9)
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
                                out / f"util_{file_stem(model)}_{precision}_b{batch}.png")
        if path:
            paths.append(path)
    return paths

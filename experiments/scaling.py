"""Gain vs branch count and branch size on the synthetic net, measured beside the scheduler's prediction.

    python -m experiments.scaling --out experiments/results/2026-12-01-h100/scaling
    python -m experiments.scaling --cpu-smoke --out /tmp/scaling     # prediction only, tiny nets

For branches in 1, 2, 4, 8, 16 and two widths, ``branchy:<branches>x<width>``
runs as ``serial_graph`` and ``concur_graph:<k>`` (k = min(branches, 8)) through
:mod:`experiments.sweep` (one subprocess each, resumable, same files), and the
plot puts measured serial/concur beside ``concur.inspect(...).predicted_speedup[k]``
(computed in the child, on the device the model runs on). Without CUDA the
measured points are "skipped: no CUDA" and only the prediction is plotted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.sweep import report
from experiments.sweep.children import run_sweep
from experiments.sweep.rows import default_out, run_meta

BRANCHES = [1, 2, 4, 8, 16]
WIDTHS = [32, 128]


def scaling_points(rows: list[dict]) -> list[dict]:
    """Return per (branches, width): streams, predicted and measured speedup (None where not measured)."""
    from experiments.sweep_models import parse_branchy

    points = {}
    for r in rows:
        if not r["model"].startswith("branchy:") or r.get("status") != "ok":
            continue
        p = points.setdefault(parse_branchy(r["model"]), {})
        if r["mode"] == "serial_graph":
            p["serial_ms"] = r["ms"]
        elif r["mode"].split(":")[0] in ("concur_graph", "eager_streams"):
            p[r["mode"].split(":")[0] + "_ms"] = r["ms"]
            p["streams"] = r.get("graph_streams") or r.get("streams_requested")
            p["predicted"] = r.get("predicted_speedup")
    out = []
    for (branches, width), p in sorted(points.items()):
        measured = p["serial_ms"] / p["concur_graph_ms"] if "serial_ms" in p and "concur_graph_ms" in p else None
        out.append(dict(branches=branches, width=width, streams=p.get("streams"), predicted=p.get("predicted"),
                        measured=measured))
    return out


def plot(points: list[dict], meta: dict, path: Path) -> Path:
    """Speedup vs branch count, one colour per width: measured solid, predicted dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, width in enumerate(sorted({p["width"] for p in points})):
        sel = [p for p in points if p["width"] == width]
        color = f"C{i}"
        pred = [(p["branches"], p["predicted"]) for p in sel if p["predicted"] is not None]
        meas = [(p["branches"], p["measured"]) for p in sel if p["measured"] is not None]
        if pred:
            ax.plot(*zip(*pred), ls="--", marker="x", color=color, label=f"width {width}: predicted")
        if meas:
            ax.plot(*zip(*meas), ls="-", marker="o", color=color, label=f"width {width}: measured")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("branches per block")
    ax.set_ylabel("speedup over the serial graph")
    ax.set_title(f"branchy net: {report.meta_line(meta)}", fontsize=9)
    ax.legend(fontsize=8)
    return report.save_figure(fig, path, meta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--branches", nargs="+", type=int, help=f"default {BRANCHES}")
    parser.add_argument("--widths", nargs="+", type=int, help=f"default {WIDTHS}")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", type=Path, help="default experiments/results/<date>-<gpu>/scaling")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--timeout-per-config", type=float, default=600.0)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="defaults widths 8 16, branches 1 2 4, batch 2, 32px: the plumbing and the prediction")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.branches = args.branches or ([1, 2, 4] if smoke else BRANCHES)
    args.widths = args.widths or ([8, 16] if smoke else WIDTHS)
    args.batch = args.batch or (2 if smoke else 32)
    if smoke:
        args.repeats = min(args.repeats, 2)
    meta = run_meta()
    out = args.out or default_out(meta) / "scaling"
    configs = []
    for width in args.widths:
        for branches in args.branches:
            # eager_streams carries the prediction on CPU, where graphs are skipped
            for mode in ["serial_graph", f"concur_graph:{min(branches, 8)}",
                         *([f"eager_streams:{min(branches, 8)}"] if args.cpu_smoke else [])]:
                configs.append(dict(model=f"branchy:{branches}x{width}", batch=args.batch, precision=args.precision,
                                    mode=mode, repeats=args.repeats, warmup=1 if args.cpu_smoke else 5,
                                    out=str(out), **({"image_size": 32} if args.cpu_smoke else {})))
    rows, _ = run_sweep(configs, out, args.resume, args.timeout_per_config)
    points = scaling_points(rows)
    (out / "scaling.json").write_text(json.dumps(dict(meta=meta, points=points), indent=1))
    report.write_reports(rows, meta, out)
    print(plot(points, meta, out / "scaling.png"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

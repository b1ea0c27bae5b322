"""The tables of issue 22's benchmark, from its results.jsonl files.

    python -m experiments.bench22_table experiments/results/2026-11-23f-h100-torch2.11/bench22

Every ratio divides two rows of one configuration (model, batch, precision)
measured in the same part of the run, timed in turns in one process; rows of
different parts are never divided by each other. Ratios are compile + graph's
step time over the variant's (above 1: the variant is faster), and the
variant's peak memory and setup (compile and capture) time over compile +
graph's.

"Compile + graph" is the sweep's mode ``compile_graph``: concur's own step on
one stream (``train_step(compile=True, streams=1)``), concur's backend and
capture. It is not PyTorch's recipe; the ratios against that, written without
concur in experiments/peers.py, are issue 28's (experiments/bench28.sh, the
sweep's ``peer_compile_graph`` mode and its summary.md).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from experiments.sweep.rows import read_rows

BASE = "compile_graph"  # concur's own one-stream step, as issue 22 measured against it (not the peer recipe)
VARIANTS = ("fused:4", "fused_noprio:4", "fused_nosplit:4", "fused_gate105:4", "fused_ordered:4")
# the other variants' columns: (mode, header, what to print of it)
OTHER_COLUMNS = (("fused_noprio:4", "no priority", "speedup"), ("fused_nosplit:4", "no split", "speedup"),
                 ("fused_gate105:4", "gate 1.05", "speedup"), ("fused_ordered:4", "ordered reuse", "speedup"),
                 ("fused_ordered:4", "its memory", "memory"))

# issue 22's targets for concur fused (bf16) against compile_graph (concur's one-stream step), by (model, batches)
TARGETS = {("googlenet", (8,)): 1.35, ("googlenet", (64, 128)): 1.12, ("inception_v3", (8,)): 1.30,
           ("inception_v3", (64, 128)): 1.10, ("resnet50", (8, 32)): 1.05, ("resnet50", (64, 128)): 1.02,
           ("torchvision:vit_b_16", (32, 64)): 1.03, ("timm:dla34", (8,)): 1.10,
           ("timm:hrnet_w18_small", (8,)): 1.10, ("timm:inception_v4", (8,)): 1.10}
FLOOR = 0.99


def target(model: str, batch: int) -> float:
    return next((t for (m, batches), t in TARGETS.items() if m == model and batch in batches), FLOOR)


def by_configuration(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """The rows that ran, as {(part, model, batch, precision): {mode: row}}: what may be divided by what."""
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if r.get("status") == "ok":
            groups[(r["part"], r["model"], r["batch"], r["precision"])][r["mode"]] = r
    return groups


def ratios(rows: list[dict]) -> list[dict]:
    """One entry per (part, model, batch, precision): each variant's speedup, memory and setup ratios."""
    groups = {key: {mode: r for mode, r in modes.items() if r.get("ms")}
              for key, modes in by_configuration(rows).items()}
    out = []
    for (part, model, batch, precision), modes in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        base = modes.get(BASE)
        if base is None:
            continue
        entry = dict(part=part, model=model, batch=batch, precision=precision, base_ms=base["ms"])
        for v in VARIANTS:
            if v in modes:
                r = modes[v]
                entry[v] = dict(speedup=base["ms"] / r["ms"], memory=r["peak_mb"] / base["peak_mb"],
                                setup=r["setup_s"] / base["setup_s"])
        out.append(entry)
    return out


def markdown(entries: list[dict]) -> list[str]:
    columns = [c for c in OTHER_COLUMNS if any(c[0] in e for e in entries)]
    header = ["model", "batch", "precision", "part", "compile + graph, ms", "fused (defaults)", "target", "met",
              "memory", "setup", *(c[1] for c in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for e in entries:
        f = e.get("fused:4")
        if f is None:
            continue
        t = target(e["model"], e["batch"])
        other = [f"{e[mode][what]:.3f}x" if mode in e else "" for mode, _, what in columns]
        lines.append(f"| {e['model']} | {e['batch']} | {e['precision']} | {e['part']} | {e['base_ms']:.2f} | {f['speedup']:.3f}x | "
                     f"{t:.2f}x | {'yes' if f['speedup'] >= t else 'no'} | {f['memory']:.2f}x | {f['setup']:.2f}x | "
                     + " | ".join(other) + " |")
    return lines


def unfused(rows: list[dict]) -> list[str]:
    """The unfused path per (part, model, batch, precision): split and unsplit against the serial graph, and the bound.

    Achieved is the serial graph's step time over the concur graph's (the whole step); the bound is the
    forward pass's serial kernel time over its critical path (``critical_path`` rows).
    """
    groups = by_configuration(rows)
    lines = ["| model | batch | precision | part | serial graph, ms | concur graph (split) | no split | split gain "
             "| bound | achieved/bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (part, model, batch, precision), modes in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        serial, split, nosplit = (modes.get(m) for m in ("serial_graph", "concur_graph:4", "concur_graph_nosplit:4"))
        bound = modes.get("critical_path", {}).get("bound_speedup")
        if not (serial and split and nosplit and bound):
            continue
        achieved = serial["ms"] / split["ms"]
        lines.append(f"| {model} | {batch} | {precision} | {part} | {serial['ms']:.2f} | {achieved:.3f}x | "
                     f"{serial['ms'] / nosplit['ms']:.3f}x | {nosplit['ms'] / split['ms']:.3f}x | {bound:.2f}x | "
                     f"{achieved / bound:.2f} |")
    return lines if len(lines) > 2 else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="holds results.jsonl (and repeat_results.jsonl, if any)")
    args = parser.parse_args(argv)
    for name in ("results.jsonl", "repeat_results.jsonl"):
        path = args.run_dir / name
        if path.exists():
            print(f"\n{name}\n")
            rows = read_rows(path)
            print("\n".join(markdown(ratios(rows))))
            table = unfused(rows)
            if table:
                print(f"\n{name}, the unfused path\n")
                print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The zoo's table: each network's concur step against the recipe, beside the decisions that made it.

    python3 -m experiments.zoo_decisions RUN_DIR [--jsonl OUT.jsonl]

RUN_DIR is a run of ``experiments/zoo.sh`` (the sweep's ``results.jsonl``,
and ``decisions/<configuration>/decisions/*.json``, one cache per fused
configuration). Prints one markdown row per network and route, slowest first:
the route (fused: ``fused:4`` against compile + graph; unfused: ``concur_graph:4``
against the eager whole-step capture), the recipe's and concur's step (ms),
their ratio, then per graph the streams it kept alone, its measured speedup and
the raw prediction, and the decision over the whole step. ``--jsonl`` writes every decision, one line each, with its
configuration and scope ("graph", or "step" for the whole step's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.sweep.configs import file_stem

# route: (the recipe's mode, concur's mode)
ROUTES = {"fused": ("peer_compile_graph", "fused:4"), "unfused": ("peer_eager_graph", "concur_graph:4")}


def read_decisions(run: Path) -> dict[str, list[dict]]:
    """Return each configuration's measured decisions (its cache's entries), each with its ``scope``."""
    found: dict[str, list[dict]] = {}
    for path in sorted(run.glob("decisions/*/decisions/*.json")):
        try:
            result = json.loads(path.read_text())["result"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if "one_stream_ms" not in result:
            continue
        # caches written before decisions said their scope: a whole step's decision names the forward and backward
        scope = result.get("scope") or ("step" if "forward and backward" in result.get("what", "") else "graph")
        found.setdefault(path.parent.parent.name, []).append(dict(result, scope=scope))
    return found


def _kind(decision: dict) -> str:
    what = decision.get("what", "")
    return "step" if decision["scope"] == "step" else "backward" if "backward" in what else "forward"


def _cell(decision: dict | None, step: bool = False) -> str:
    if decision is None:
        return "—" if step else "1, not timed"
    measured = decision["one_stream_ms"] / decision["streams_ms"]
    kept = ("kept" if decision["keep"] else "dropped") if step else ("4" if decision["keep"] else "1")
    return f"{kept}, {measured:.2f}x ({decision['predicted_speedup']:.2f}x)"


def _pairs(run: Path):
    """Yield (model, batch, route, the recipe's row, concur's row) for each configuration timed on both."""
    rows: dict[tuple, dict] = {}
    for line in (run / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("status") == "ok":
            rows.setdefault((r["model"], r["batch"], r["precision"]), {})[r["mode"]] = r
    for (model, batch, precision), modes in rows.items():
        for route, (peer_mode, concur_mode) in ROUTES.items():
            if peer_mode in modes and concur_mode in modes:
                yield model, batch, route, modes[peer_mode], modes[concur_mode]


def below(run: Path, ratio: float) -> list[tuple[str, str]]:
    """Return (model, route) of each configuration whose concur step ran below ``ratio`` of the recipe's speed."""
    return sorted({(model, route) for model, _, route, peer, concur in _pairs(run)
                   if peer["ms"] / concur["ms"] < ratio})


def table(run: Path) -> list[str]:
    """Return the markdown table's lines for ``run``."""
    decisions = read_decisions(run)
    out = []
    for model, batch, route, peer_row, concur_row in _pairs(run):
        peer, concur = peer_row["ms"], concur_row["ms"]
        # the sweep's cache folder of the configuration (experiments/sweep/measure.py)
        by_kind = {_kind(d): d for d in decisions.get(file_stem(concur_row["key"]), [])}
        # the unfused route decides over the whole step only: its graphs have no cells of their own
        graphs = [_cell(by_kind.get(k)) if route == "fused" else "—" for k in ("forward", "backward")]
        out.append((peer / concur, f"| {model.split(':')[-1]} | {batch} | {route} | {peer:.2f} | {concur:.2f} | "
                    f"**{peer / concur:.3f}x** | {graphs[0]} | {graphs[1]} | "
                    f"{_cell(by_kind.get('step'), step=True)} |"))
    head = ["| network | batch | route | recipe ms | concur ms | concur vs recipe | forward: streams, measured "
            "(predicted) | backward: streams, measured (predicted) | whole step: decision, measured (predicted) |",
            "|---|---|---|---|---|---|---|---|---|"]
    return head + [line for _, line in sorted(out)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a zoo.sh run directory")
    ap.add_argument("--jsonl", type=Path, help="write every decision here, one line each")
    ap.add_argument("--below", type=float, help="print only the models (one line each: model route) that ran "
                                                "below this ratio to the recipe, for a run alone")
    args = ap.parse_args(argv)
    if args.below is not None:
        for model, route in below(args.run, args.below):  # none below: no line (zoo.sh reads one per model)
            print(f"{model} {route}")
        return 0
    print("\n".join(table(args.run)))
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for config, found in read_decisions(args.run).items():
                for d in found:
                    f.write(json.dumps({"config": config, **d}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The zoo's table: each network's fused step against the recipe, beside the decisions that made it.

    python3 -m experiments.zoo_decisions RUN_DIR [--jsonl OUT.jsonl]

RUN_DIR is a run of ``experiments/bench29.sh`` (the sweep's ``results.jsonl``,
and ``decisions/<configuration>/decisions/*.json``, one cache per fused
configuration). Prints one markdown row per network, slowest first: the
recipe's and concur's step (ms), their ratio, then per graph the streams it
kept alone, its measured speedup and the raw prediction, and the decision over
the whole step. ``--jsonl`` writes every decision, one line each, with its
configuration and scope ("graph", or "step" for the whole step's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.sweep.configs import file_stem

PEER, FUSED = "peer_compile_graph", "fused:4"


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


def table(run: Path) -> list[str]:
    """Return the markdown table's lines for ``run``."""
    rows: dict[tuple, dict] = {}
    for line in (run / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("status") == "ok":
            rows.setdefault((r["model"], r["batch"], r["precision"]), {})[r["mode"]] = r
    decisions = read_decisions(run)
    out = []
    for (model, batch, precision), modes in rows.items():
        if PEER not in modes or FUSED not in modes:
            continue
        peer, fused = modes[PEER]["ms"], modes[FUSED]["ms"]
        # the sweep's cache folder of the configuration (experiments/sweep/measure.py)
        by_kind = {_kind(d): d for d in decisions.get(file_stem(modes[FUSED]["key"]), [])}
        out.append((peer / fused, f"| {model.split(':')[-1]} | {batch} | {peer:.2f} | {fused:.2f} | "
                    f"**{peer / fused:.3f}x** | {_cell(by_kind.get('forward'))} | {_cell(by_kind.get('backward'))} | "
                    f"{_cell(by_kind.get('step'), step=True)} |"))
    head = ["| network | batch | recipe ms | fused ms | fused vs recipe | forward: streams, measured (predicted) | "
            "backward: streams, measured (predicted) | whole step: decision, measured (predicted) |",
            "|---|---|---|---|---|---|---|---|"]
    return head + [line for _, line in sorted(out)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench29.sh run directory")
    ap.add_argument("--jsonl", type=Path, help="write every decision here, one line each")
    args = ap.parse_args(argv)
    print("\n".join(table(args.run)))
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for config, found in read_decisions(args.run).items():
                for d in found:
                    f.write(json.dumps({"config": config, **d}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

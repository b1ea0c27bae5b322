"""What the fused route's reading and emission cost on the host, per graph: the checked-in CUDA wrappers.

    PYTHONPATH=. python -m experiments.emit_cost [--streams 2 3 4] [--match googlenet] [--json out.jsonl]

For each golden CUDA wrapper (``tests/fixtures/wrappers/torch*-cuda*``), times
what the backend does on the host before anything runs on a GPU: parsing the
wrapper into its launch DAG (:func:`concur.inductor.wrapper_parse.parse_wrapper`,
with split reuses), scheduling it on each stream count, and, per distinct
candidate, emitting its plan (:func:`~concur.inductor.wrapper_emit.plan_emission`)
and building its call (:func:`~concur.inductor.wrapper_build.build_call`).
``streams="auto"`` builds every candidate it times (three per graph where
2, 3 and 4 streams schedule apart), the default one; so this is setup time
``"auto"`` adds whatever the GPU does. Wall times on this machine, best of
``--repeats``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from concur.dag import decide
from concur.inductor.wrapper_build import build_call
from concur.inductor.wrapper_emit import launch_dag, plan_emission
from concur.inductor.wrapper_parse import parse_wrapper, source_namespace

WRAPPERS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "wrappers"


def _best(repeats: int, fn):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def cost(path: Path, counts: tuple[int, ...], repeats: int) -> dict:
    """Seconds to parse, schedule, plan and build one wrapper's candidates."""
    source = gzip.open(path / "wrapper.py.gz", "rt").read()
    namespace = source_namespace(source)
    parse_s, program = _best(repeats, lambda: parse_wrapper(source, namespace, split_reuses=True))
    dag = launch_dag(program, {}, 1.0)
    schedule_s, schedules = _best(repeats, lambda: decide.distinct_schedules(dag, counts, "critical_path", 2.0))
    candidates = [s for s in schedules if s.num_streams > 1]
    plan_s, plans = _best(repeats, lambda: [plan_emission(program, s, dag) for s in candidates])
    build_s, _ = _best(repeats, lambda: [build_call(program, p, dict(namespace)) for p in plans])
    return {"wrapper": f"{path.parent.name}/{path.name}", "launches": len(program.launches),
            "candidates": len(candidates), "parse_s": parse_s, "schedule_s": schedule_s, "plan_s": plan_s,
            "build_s": build_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=list(decide.AUTO_STREAMS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default="torch2.11.0-cuda", help="wrapper folders whose name starts with this")
    ap.add_argument("--match", default="", help="only the wrappers whose name holds this (resnet50_fp32_fwd)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    print("| wrapper | launches | candidates | parse s | schedule s | plan s | build s |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(p for d in sorted(WRAPPERS.glob(f"{args.only}*")) for p in d.iterdir()
                       if p.is_dir() and args.match in p.name):
        row = cost(path, tuple(args.streams), args.repeats)
        print(f"| {row['wrapper']} | {row['launches']} | {row['candidates']} | {row['parse_s']:.2f} | "
              f"{row['schedule_s']:.2f} | {row['plan_s']:.2f} | {row['build_s']:.2f} |", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

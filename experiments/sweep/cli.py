"""The command line of ``python -m experiments.sweep``: the options, then a sweep, a combine or a report.

The children run through the same command line (``--one``, ``--group``), so
a child is a plain interpreter started with the repository on its path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import experiments.sweep
from experiments.sweep.children import run_sweep
from experiments.sweep.combine import combine_runs
from experiments.sweep.configs import ALL_MODES, DEFAULT_BATCHES, PRECISIONS, SMOKE, make_configs
from experiments.sweep.measure import child_group_main, child_main
from experiments.sweep.report import write_reports
from experiments.sweep.rows import default_out, meta_of_rows, read_rows, run_meta


def main(argv: list[str] | None = None) -> int:
    """Run the sweep the arguments describe (or a child's configurations, or a report); return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep", description=experiments.sweep.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args.together = [t.replace("+", ",") for t in args.together]  # '+' where commas are taken (the device scripts' arguments)
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
        rows, launched = run_sweep(make_configs(args), args.out, args.resume, args.timeout_per_config)
    for path in write_reports(rows, meta_of_rows(rows, meta), args.out):
        print(path, file=sys.stderr)
    print(f"launched {launched} configuration(s); {len(rows)} rows in {args.out / 'results.jsonl'}", file=sys.stderr)
    return 0

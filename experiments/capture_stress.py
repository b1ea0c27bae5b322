"""Captures under load: the GPU tests side by side with copies of themselves, every capture counted.

    PYTHONPATH=. python -m experiments.capture_stress --out DIR [--copies 3] [--rounds 2] [--deadline 500]

Each round starts, side by side, ``--copies`` processes of the train-step
habits tests (tests/test_gpu_train_habits.py: freezing, eval, new param
groups, loading state: each a re-capture), the capture-failure tests and the
fused sanitizer tests named by ``--beside`` (each compiles a network), and
waits for them. Every process loads this module as a pytest plugin, which
counts, for every ``train_step`` capture, what its step's
:attr:`~concur.training.step.TrainStep.status` went through: captures,
failed attempts, failures a retry recovered, and input shapes left eager.
DIR/capture_stress.jsonl gets one row per process (its test outcome and
counts); the totals are printed. A capture lost under load shows as a
failure, and as an eager shape where no retry or fallback recovered it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COUNTS = ("captures", "failures", "recovered", "eager_shapes")
_counts: collections.Counter = collections.Counter()

# the capture-heavy tests run in copies; the sanitizer tests beside them compile and time networks
HABITS = "tests/test_gpu_train_habits.py"
FAILURES = "tests/test_gpu_capture_failure.py"
BESIDE = ("tests/test_gpu_backend.py::test_fused_path_under_the_sanitizer_reports_no_race[googlenet-reuse]",
          "tests/test_gpu_backend.py::test_fused_path_under_the_sanitizer_reports_no_race[inception_v3-reuse]")


# --- the pytest plugin each process loads (-p experiments.capture_stress) ---------------------------

def pytest_configure(config: Any) -> None:
    """Count what every train_step capture goes through (its step's capture log, before and after)."""
    import concur.training.step as step_module

    capture = step_module.capture_with_fallback

    def counted(step: Any, *args: Any, **kwargs: Any) -> Any:
        log = step.capture_log
        before = (log.captures, log.failures, log.recovered)
        captured = capture(step, *args, **kwargs)
        _counts["captures"] += log.captures - before[0]
        _counts["failures"] += log.failures - before[1]
        _counts["recovered"] += log.recovered - before[2]
        _counts["eager_shapes"] += captured is None
        return captured

    step_module.capture_with_fallback = counted


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("CAPTURE_STRESS_COUNTS")
    if path:
        Path(path).write_text(json.dumps({**{k: _counts[k] for k in COUNTS}, "exitstatus": int(exitstatus)}))


# --- the parent ------------------------------------------------------------------------------------

def _start(name: str, target: str, out: Path, env: dict[str, str]) -> tuple[str, subprocess.Popen, Path, Path]:
    counts, log = out / f"{name}.counts.json", out / f"{name}.log"
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                "-p", "experiments.capture_stress", target], cwd=REPO,
                               env={**env, "CAPTURE_STRESS_COUNTS": str(counts)},
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
    return name, process, counts, log


def run(out: Path, copies: int, rounds: int, beside: tuple[str, ...], deadline_s: float) -> list[dict]:
    """Run the rounds; return one row per process."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TORCHINDUCTOR_COMPILE_THREADS": "2"}
    started, rows = time.monotonic(), []
    for r in range(rounds):
        if time.monotonic() - started > deadline_s / 2:
            break  # a round takes about as long as the last: leave room to report
        targets = [(f"r{r}_habits{c}", HABITS) for c in range(copies)] + [(f"r{r}_failures", FAILURES)] + \
                  [(f"r{r}_beside{i}", t) for i, t in enumerate(beside)]
        procs = [_start(name, target, out, env) for name, target in targets]
        for name, process, counts, log in procs:
            try:
                process.wait(timeout=max(deadline_s - (time.monotonic() - started), 1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            row: dict[str, Any] = {"process": name, "target": next(t for n, t in targets if n == name),
                                   "returncode": process.returncode}
            if counts.exists():
                row.update(json.loads(counts.read_text()))
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            row["summary"] = tail[0][:300] if tail else ""
            rows.append(row)
    with (out / "capture_stress.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def totals(rows: list[dict]) -> dict[str, int]:
    """Captures, failures, recoveries and eager shapes over every process; processes that failed their tests."""
    total = {k: sum(r.get(k, 0) for r in rows) for k in COUNTS}
    total["processes"] = len(rows)
    total["processes_failed"] = sum(r["returncode"] not in (0, 5) for r in rows)  # 5: every test skipped
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--copies", type=int, default=3, help="copies of the habits tests side by side")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--beside", nargs="*", default=list(BESIDE), help="pytest ids run beside them, one process each")
    ap.add_argument("--deadline", type=float, default=500.0, help="seconds for all rounds")
    args = ap.parse_args(argv)
    if args.copies < 1 or args.rounds < 1:
        ap.error("--copies and --rounds must be at least 1")
    rows = run(args.out, args.copies, args.rounds, tuple(args.beside), args.deadline)
    for row in rows:
        print(f"{row['process']:>14} rc={row['returncode']} " + " ".join(f"{k}={row.get(k, '?')}" for k in COUNTS)
              + f"  {row['summary']}")
    print("totals", json.dumps(totals(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

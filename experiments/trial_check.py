"""How an unfused step's first calls time its programs (concur.training.trial), beside the same programs timed
steadily: does the trial see what the steps then run at?

    PYTHONPATH=. python experiments/trial_check.py --model googlenet --batch 64 [--runs 2] [--replays 2]

Each run builds a step with an empty decision cache, calls it until the trial decides, and prints each counted
round's ms per program (one stream first) and the decision. Then the trial's programs, captured again, are timed
in alternating rounds of back-to-back replays (experiments/step_gap.py's timing): the steady times.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import concur
from concur.training import trial as trial_mod
from experiments.step_gap import setup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="googlenet")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--replays", type=int, default=trial_mod.REPLAYS, help="replays of a program in a row, a round")
    args = ap.parse_args()
    trial_mod.REPLAYS = args.replays
    for run in range(args.runs):
        os.environ["CONCUR_CACHE_DIR"] = tempfile.mkdtemp(prefix="concur-trial-")
        model, batch, loss_fn, opt = setup(args.model, args.batch)
        step = concur.train_step(model, loss_fn, opt(model.parameters()), batch, streams=4,
                                 amp_dtype=torch.bfloat16)
        step(*batch)
        trial = step._trial
        calls = 1
        while step.deciding and calls < 200:
            step(*batch)
            calls += 1
        torch.cuda.synchronize()
        rounds = trial.rounds() if trial is not None else []
        print(f"run {run}: {args.model} b{args.batch}, decided after {calls} calls, {trial_mod.REPLAYS} replays "
              f"a round; rounds (ms, one stream first): " + "; ".join(
                  " / ".join(f"{t:.2f}" for t in r) for r in rounds))
        for d in step.step_decisions:
            print(f"  decision: keep={d.keep}: {d.reason}")
        if trial is not None:  # the same programs, timed steadily: rounds of 20 back-to-back replays each
            for _ in range(3):
                step(*batch)
            times = {i: [] for i in range(len(trial.programs))}
            for r in range(5):
                for i, captured in enumerate(trial.programs):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(20):
                        captured.graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times[i].append(start.elapsed_time(end) / 20)
            print("  steady, the trial's programs replayed 20 in a row: " + " / ".join(
                f"{sorted(t)[len(t) // 2]:.2f}" for t in times.values()) + " ms (one stream first)")
        del step, trial
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

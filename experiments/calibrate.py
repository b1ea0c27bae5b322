"""Fit the contention model's predicted speedup to measured decisions, and report both against the measurements.

Each measured decision in a ``decisions/`` cache (:mod:`concur.dag.decide`)
holds one graph's prediction (speedup, ideal speedup, serial and multi-stream
us, streams) and the medians of its one-stream and multi-stream replays; the
measured speedup is one_stream_ms / streams_ms. This script reads every such
entry under the directories given (a ``$CONCUR_CACHE_DIR``, a directory of
decision files, or a run's tree ``DIR/<model-config>/decisions/*.json``: the
model is the nearest directory above an entry not named ``decisions``),
fits a :class:`concur.dag.calibration.Calibration` (least squares on the
fraction of one stream's time saved, weighted so that it minimises relative
error), and prints per graph the prediction, the calibrated prediction and
the measurement, with the mean absolute relative error (MAE) of each.

The calibrated column and its MAE are cross-validated, one network left out
at a time: each network's rows are calibrated by constants fitted on the
other networks only, so the fit is never graded on its own rows. A model's
network is its name up to a ``-b<batch>`` or ``_b<batch>`` suffix
(``googlenet-b32-bf16`` is GoogLeNet), so all batch sizes of a network leave
together.

    python experiments/calibrate.py RUN_DIR...                      # report; print the constants
    python experiments/calibrate.py RUN_DIR... --write              # ... and store them in concur/dag/calibration.py
    python experiments/calibrate.py --sweep experiments/results/*/sweep/results.jsonl   # older whole-step rows

Fits (``--fit``): ``shrink`` (default) fits one number, the share of the
predicted saving the GPU delivers; ``contention`` adds the ideal schedule's
saving beyond the shared one, a refit of how much contention the model counts.
Both are reported; the one chosen is written. ``--sweep`` reads a sweep's
results.jsonl (unfused ``concur_graph:K`` against ``serial_graph`` of the same
model, batch and precision: whole steps against the prediction of
``concur.inspect``), for a look at older runs; the shipped constants come from
decision entries. Rows go to ``--rows`` as JSONL. Without CUDA here, name the
GPU the entries were measured on with ``--gpu`` (decision entries do not
record it).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from concur.dag.calibration import Calibration  # noqa: E402
from experiments.calibration.constants import ROOT, TARGET, render, write  # noqa: E402
from experiments.calibration.fit import FITS, report  # noqa: E402
from experiments.calibration.rows import read_decisions, read_sweep  # noqa: E402
from experiments.calibration.table import summary, table  # noqa: E402


def _one(values: set, what: str) -> str | None:
    values.discard(None)
    if len(values) > 1:
        raise SystemExit(f"calibrate: rows of several {what}s ({', '.join(sorted(values))}): pass --{what} to pick one")
    return next(iter(values), None)


def _cuda_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="*", type=Path, help="directories of measured decisions, searched at any depth")
    p.add_argument("--sweep", nargs="+", type=Path, default=[], help="sweep results.jsonl files (whole steps)")
    p.add_argument("--fit", choices=sorted(FITS), default="shrink", help="what to fit and write (default shrink)")
    p.add_argument("--gpu", help="the GPU the rows were measured on (default: theirs, else this machine's)")
    p.add_argument("--torch", help="the torch version they were measured with (default: theirs, else the installed)")
    p.add_argument("--rows", type=Path, default=Path("calibration_rows.jsonl"), help="where the rows go (JSONL)")
    p.add_argument("--write", nargs="?", type=Path, const=TARGET, default=None,
                   help=f"store the fitted constants in this file (default {TARGET.relative_to(ROOT)})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.dirs and not args.sweep:
        raise SystemExit("calibrate: name directories of measured decisions (or --sweep files)")
    rows, skipped = read_decisions(args.dirs)
    rows += read_sweep(args.sweep)
    if args.gpu:
        other = [r for r in rows if r.gpu not in (None, args.gpu)]
        rows = [r for r in rows if r.gpu in (None, args.gpu)]
        if other:
            print(f"left out {len(other)} rows measured on other GPUs than {args.gpu}")
    if not rows:
        raise SystemExit(f"calibrate: no measured decision under {', '.join(map(str, args.dirs + args.sweep))} "
                         f"({skipped} other JSON files): run with a GPU and measured decisions on (CONCUR_MEASURE=1)")
    gpu = args.gpu or _one({r.gpu for r in rows}, "gpu") or _cuda_name()
    torch_version = args.torch or _one({r.torch for r in rows}, "torch") or importlib.metadata.version("torch")
    date = max((r.date for r in rows if r.date), default=datetime.date.today().isoformat())

    try:
        chosen = report(rows, args.fit)
    except ValueError as exc:
        raise SystemExit(f"calibrate: {exc}; measure more graphs, or --fit shrink")
    others = []
    for name in FITS:
        try:
            others += [report(rows, name)] if name != args.fit else []
        except ValueError as exc:  # too few rows for its constants
            print(f"fit {name}: {exc}")
    print(table(chosen))
    print(f"\non {gpu or 'a GPU not named (pass --gpu)'}, torch {torch_version}, measured {date}"
          + (f"; {skipped} other JSON files passed over" if skipped else ""))
    print(summary(chosen, others))

    calibrated = chosen.held_out if chosen.held_out is not None else chosen.in_sample
    args.rows.parent.mkdir(parents=True, exist_ok=True)
    with args.rows.open("w") as f:
        for r, held, fitted in zip(chosen.rows, calibrated, chosen.in_sample):
            f.write(json.dumps({**asdict(r), "calibrated": held, "calibrated_in_sample": fitted,
                                "fit": args.fit}) + "\n")
    print(f"rows: {args.rows}")

    if gpu is None:
        if args.write:
            raise SystemExit("calibrate: name the GPU these rows were measured on (--gpu 'NVIDIA H100 80GB HBM3')")
        return 0
    from concur.dag.cost import roofline_for  # imports torch: only once there is something to write

    cal = Calibration(gpu=gpu, roofline=roofline_for(gpu).name, **chosen.weights, rows=len(chosen.rows),
                      networks=len({r.network for r in chosen.rows}), torch=torch_version, date=date,
                      mae_raw=chosen.mae_raw, mae_calibrated=chosen.mae_held_out)
    if args.write:
        write(args.write, cal)
        print(f"constants: written to {args.write}")
    else:
        print("\nconstants (--write stores them in concur/dag/calibration.py):\n"
              + render({gpu: cal}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ``train_step(compile=True, streams="auto")`` measures and keeps, per model and batch.

    python -m experiments.auto_fused --models torchvision:vit_b_16 googlenet --batch 64 --out DIR

bf16 autocast with a channels-last model, SGD momentum, as the sweep. Prints
each model's trials (1, 2, ... streams, compiled, captured, timed by the
tuner with CUDA events) and the kept stream count, and writes them to
``DIR/auto_fused.jsonl``. The point is the never-slower rule: the kept
configuration is never one measured slower than the serial graph.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

import concur
import concur.observe.tuner as tuner_mod
from experiments.sweep_models import build


def measure(name: str, batch: int) -> dict:
    """Run streams="auto" with compile=True on one model; return its trials and choice."""
    results = []
    real = tuner_mod.tune_train_step

    def spy(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    tuner_mod.tune_train_step = spy
    try:
        torch.manual_seed(0)
        model, size = build(name)
        cl = torch.channels_last
        model = model.cuda().train().to(memory_format=cl)
        x = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=cl)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        concur.train_step(model, nn.CrossEntropyLoss(), opt, (x, y), streams="auto", compile=True,
                          amp_dtype=torch.bfloat16)
    finally:
        tuner_mod.tune_train_step = real
        torch._dynamo.reset()
    (result,) = results
    trials = [dict(streams=t.config.streams, median_ms=t.measurement.median_ms if t.measurement else None,
                   iqr_ms=t.measurement.iqr_ms if t.measurement else None, error=t.error, seconds=round(t.seconds, 1))
              for t in result.trials]
    return dict(model=name, batch=batch, precision="bf16", chosen=result.config.streams, stopped=result.stopped,
                trials=trials, seconds=round(result.seconds, 1), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    os.environ.setdefault("CONCUR_CACHE_DIR", tempfile.mkdtemp())  # measure, do not read an earlier result
    args.out.mkdir(parents=True, exist_ok=True)
    print("| model | batch | trials (streams: ms) | kept | kept vs serial |")
    print("|---|---|---|---|---|")
    for name in args.models:
        row = measure(name, args.batch)
        with open(args.out / "auto_fused.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        times = {t["streams"]: t["median_ms"] for t in row["trials"] if t["median_ms"] is not None}
        shown = ", ".join(f"{k}: {v:.2f}" for k, v in times.items())
        kept = times.get(row["chosen"])
        ratio = f"{times[1] / kept:.3f}x" if kept and 1 in times else "n/a"
        print(f"| {name} | {args.batch} | {shown} | {row['chosen']} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

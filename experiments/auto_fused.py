"""What ``train_step(compile=True, streams="auto")`` measures and keeps, per model and batch.

    python -m experiments.auto_fused --models torchvision:vit_b_16 googlenet --batch 64 --out DIR

bf16 autocast with a channels-last model, SGD momentum, as the sweep. Prints
each decision ``streams="auto"`` made: per compiled graph, inductor's own
call (one stream) and the plans on 2, 3 and 4 streams of the same compile,
timed in the same alternating rounds (``concur.dag.decide.choose``), then the
step's decision over the whole captured step; writes them to
``DIR/auto_fused.jsonl``. The point is the never-slower rule: nothing is kept
that was not measured faster than one stream. (Before 2026-11-25 ``"auto"``
ran the tuner, which compiled and timed a whole step per stream count.)
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
import concur.dag.decide as decide_mod
from experiments.sweep_models import build


def _row(d: "decide_mod.Decision") -> dict:
    m = d.measured
    return dict(streams=d.num_streams, source=d.source, one_stream_ms=m.one_stream_ms if m else None,
                kept_ms=m.streams_ms if m else None, candidates_ms=list(m.candidates_ms) if m else [],
                predicted=round(d.prediction.speedup, 4))


def measure(name: str, batch: int) -> dict:
    """Run streams="auto" with compile=True on one model; return each decision it made."""
    decisions = []
    real = decide_mod.choose

    def spy(what, *args, **kwargs):
        decisions.append((what, real(what, *args, **kwargs)))
        return decisions[-1][1]

    decide_mod.choose = spy
    try:
        torch.manual_seed(0)
        model, size = build(name)
        cl = torch.channels_last
        model = model.cuda().train().to(memory_format=cl)
        x = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=cl)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step = concur.train_step(model, nn.CrossEntropyLoss(), opt, (x, y), streams="auto", compile=True,
                                 amp_dtype=torch.bfloat16)
        step(x, y)
        torch.cuda.synchronize()
    finally:
        decide_mod.choose = real
        torch._dynamo.reset()
    return dict(model=name, batch=batch, precision="bf16", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                decisions=[dict(what=what, **_row(d)) for what, d in decisions])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    os.environ.setdefault("CONCUR_CACHE_DIR", tempfile.mkdtemp())  # measure, do not read an earlier result
    args.out.mkdir(parents=True, exist_ok=True)
    print("| model | batch | decision | one stream ms | 2-4 streams ms | runs on |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        row = measure(name, args.batch)
        with open(args.out / "auto_fused.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        for d in row["decisions"]:
            one = f"{d['one_stream_ms']:.3f}" if d["one_stream_ms"] is not None else d["source"]
            many = ", ".join(f"{t:.3f}" for t in d["candidates_ms"]) or (
                f"{d['kept_ms']:.3f}" if d["kept_ms"] is not None else "-")
            print(f"| {name} | {args.batch} | {d['what'][:60]} | {one} | {many} | {d['streams']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

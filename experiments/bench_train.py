"""Training-step time: eager PyTorch vs serial CUDA graph vs concur (graph + streams), same run.

    python experiments/bench_train.py --out results.json
    python experiments/bench_train.py --models googlenet --batches 8 64 --streams 2 4

Each variant trains its own deep copy of one randomly initialised model on the
same batch; times are CUDA-event medians after warm-up, with the spread
(interquartile range) beside them; ratios compare variants of the same run.
Peak memory is the allocator's peak during capture and replay, minus what was
allocated before (model, optimizer state, data).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import time

import torch
import torch.nn as nn
import torchvision

import concur
from concur.timing import time_cuda_ms

MODELS = {
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False), 224),
    "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=False,
                                                              init_weights=False), 299),
    "resnet50": (lambda: torchvision.models.resnet50(weights=None), 224),
}
DEFAULT_BATCHES = {"googlenet": [8, 32, 64, 128], "inception_v3": [8, 32, 64, 128], "resnet50": [8, 64]}


def measure(name: str, batch: int, streams_list: list[int], repeats: int) -> list[dict]:
    make, size = MODELS[name]
    torch.manual_seed(0)
    base = make().cuda().train()
    x = torch.randn(batch, 3, size, size, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    loss_fn = nn.CrossEntropyLoss()
    rows = []

    def run_variant(label: str, streams: int | None, graph: bool) -> None:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        if streams is None:
            def fn():
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opt.step()
            setup_s = 0.0
        else:
            step = concur.train_step(model, loss_fn, opt, (x, y), streams=streams, cuda_graph=graph)
            step(x, y)
            torch.cuda.synchronize()
            setup_s = time.perf_counter() - t0
            used = step.graphs[next(iter(step.graphs))].streams if step.graphs else 0

            def fn():
                step(x, y)
        median, iqr = time_cuda_ms(fn, warmup=5, repeats=repeats)
        row = dict(model=name, batch=batch, variant=label, ms=median, iqr_ms=iqr, setup_s=setup_s,
                   peak_mb=(torch.cuda.max_memory_allocated() - before) / 2**20)
        if streams is not None:
            row["streams_planned"] = step.module.schedule.num_streams
            row["graph_streams"] = used
        rows.append(row)
        print(f"  {name:13s} b{batch:<4d} {label:22s} {median:8.2f} ms  (iqr {iqr:.2f})  "
              f"peak {row['peak_mb']:.0f} MB", flush=True)

    run_variant("eager", None, False)
    run_variant("serial graph", 1, True)
    for k in streams_list:
        run_variant(f"concur graph {k} streams", k, True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, help="batch sizes (default: per model)")
    parser.add_argument("--streams", nargs="+", type=int, default=[4])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="bench_train.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_train needs a CUDA GPU", file=sys.stderr)
        return 2
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, cuda=torch.version.cuda, concur=concur.__version__,
                driver=_driver())
    print(f"{meta['date']}  {meta['gpu']}  torch {meta['torch']}  driver {meta['driver']}")
    rows = []
    for name in args.models:
        for batch in args.batches or DEFAULT_BATCHES[name]:
            try:
                rows += measure(name, batch, args.streams, args.repeats)
            except Exception as exc:  # one failing configuration is a result, not the end
                print(f"  {name} b{batch}: FAILED {type(exc).__name__}: {exc}", flush=True)
                rows.append(dict(model=name, batch=batch, variant="error", error=f"{type(exc).__name__}: {exc}"))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print_table(rows)
    return 0


def _driver() -> str:
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        return "unknown"


def print_table(rows: list[dict]) -> None:
    print("\n| model | batch | eager ms | serial graph ms | concur ms (streams) | vs serial graph | vs eager "
          "| peak MB serial / concur |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["model"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for model, batch in keys:
        sel = {r["variant"]: r for r in rows if r["model"] == model and r["batch"] == batch}
        if "serial graph" not in sel:
            continue
        serial, eager = sel["serial graph"], sel["eager"]
        for label, r in sel.items():
            if not label.startswith("concur"):
                continue
            print(f"| {model} | {batch} | {eager['ms']:.2f} | {serial['ms']:.2f} | {r['ms']:.2f} "
                  f"({r['graph_streams']}) | {serial['ms'] / r['ms']:.2f}x | {eager['ms'] / r['ms']:.2f}x "
                  f"| {serial['peak_mb']:.0f} / {r['peak_mb']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())

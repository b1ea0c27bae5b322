"""Training-step time: eager, serial CUDA graph, concur (graph + streams), torch.compile + graph, concur fused.

    python experiments/bench_train.py --out results.json
    python experiments/bench_train.py --models googlenet --batches 8 64 --streams 2 4
    python experiments/bench_train.py --variants compile fused --precision bf16

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
from concur.observe.monitor import driver_version
from concur.observe.timing import time_cuda_ms

MODELS = {
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False), 224),
    "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=False,
                                                              init_weights=False), 299),
    "resnet50": (lambda: torchvision.models.resnet50(weights=None), 224),
}
DEFAULT_BATCHES = {"googlenet": [8, 32, 64, 128], "inception_v3": [8, 32, 64, 128], "resnet50": [8, 64]}


VARIANTS = ("eager", "serial", "concur", "compile", "fused")


def measure(name: str, batch: int, streams_list: list[int], repeats: int, variants: list[str],
            precision: str) -> list[dict]:
    make, size = MODELS[name]
    torch.manual_seed(0)
    base = make().cuda().train()
    amp_dtype = torch.bfloat16 if precision == "bf16" else None
    layout = torch.channels_last if precision == "bf16" else torch.contiguous_format
    base = base.to(memory_format=layout)
    x = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=layout)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    loss_fn = nn.CrossEntropyLoss()
    rows = []

    def run_variant(label: str, streams: int | None, graph: bool, compile: bool = False) -> None:
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
                with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                    loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
            setup_s = 0.0
        else:
            step = concur.train_step(model, loss_fn, opt, (x, y), streams=streams, cuda_graph=graph,
                                     compile=compile, amp_dtype=amp_dtype)
            step(x, y)
            while step.deciding:  # an unfused step times its programs on its first calls: setup too
                step(x, y)
            torch.cuda.synchronize()
            setup_s = time.perf_counter() - t0
            used = step.graphs[next(iter(step.graphs))].streams if step.graphs else 0

            def fn():
                step(x, y)
        median, iqr = time_cuda_ms(fn, warmup=5, repeats=repeats)
        row = dict(model=name, batch=batch, precision=precision, variant=label, ms=median, iqr_ms=iqr,
                   setup_s=setup_s, peak_mb=(torch.cuda.max_memory_allocated() - before) / 2**20)
        if streams is not None:
            row["graph_streams"] = used
            if compile:
                row["compiled_graphs"] = [dict(g.__dict__) for be in step.backends.values() for g in be.graphs]
            else:
                row["streams_planned"] = step.module.schedule.num_streams
        rows.append(row)
        print(f"  {name:13s} b{batch:<4d} {precision} {label:24s} {median:8.2f} ms  (iqr {iqr:.2f})  "
              f"peak {row['peak_mb']:.0f} MB  setup {setup_s:.1f} s", flush=True)

    for variant in variants:
        try:
            if variant == "eager":
                run_variant("eager", None, False)
            elif variant == "serial":
                run_variant("serial graph", 1, True)
            elif variant == "concur":
                for k in streams_list:
                    run_variant(f"concur graph {k} streams", k, True)
            elif variant == "compile":
                run_variant("compile graph", 1, True, compile=True)
            elif variant == "fused":
                for k in streams_list:
                    run_variant(f"concur fused {k} streams", k, True, compile=True)
        except Exception as exc:  # a failing mode is a result
            print(f"  {name} b{batch} {variant}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append(dict(model=name, batch=batch, precision=precision, variant=variant,
                             error=f"{type(exc).__name__}: {exc}"))
        torch._dynamo.reset()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, help="batch sizes (default: per model)")
    parser.add_argument("--streams", nargs="+", type=int, default=[4])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--variants", nargs="+", default=["eager", "serial", "concur"], choices=VARIANTS)
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                        help="bf16 = bf16 autocast + channels-last model and inputs")
    parser.add_argument("--out", default="bench_train.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_train needs a CUDA GPU", file=sys.stderr)
        return 2
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, cuda=torch.version.cuda, concur=concur.__version__,
                driver=driver_version())
    print(f"{meta['date']}  {meta['gpu']}  torch {meta['torch']}  driver {meta['driver']}")
    rows = []
    for precision in args.precision:
        for name in args.models:
            for batch in args.batches or DEFAULT_BATCHES[name]:
                try:
                    rows += measure(name, batch, args.streams, args.repeats, args.variants, precision)
                except Exception as exc:  # one failing configuration is a result, not the end
                    print(f"  {name} b{batch}: FAILED {type(exc).__name__}: {exc}", flush=True)
                    rows.append(dict(model=name, batch=batch, precision=precision, variant="error",
                                     error=f"{type(exc).__name__}: {exc}"))
                with open(args.out, "w") as f:  # after every configuration: a cut-off run keeps its rows
                    json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    """Print each variant's time and its ratio to the baseline of its kind, from the same run.

    Unfused concur is compared with the serial CUDA graph; concur fused with
    torch.compile + whole-step graph (the alternative a user would pick).
    """
    print("\n| model | batch | precision | variant | ms (iqr) | vs its baseline | peak MB (baseline) | setup s |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["model"], r["batch"], r.get("precision", "fp32")) for r in rows})
    for model, batch, precision in keys:
        sel = {r["variant"]: r for r in rows if (r["model"], r["batch"], r.get("precision", "fp32"))
               == (model, batch, precision) and "ms" in r}
        for label, r in sel.items():
            base = sel.get("compile graph" if "fused" in label else "serial graph")
            ratio = f"{base['ms'] / r['ms']:.2f}x" if base and base is not r else ""
            peak = f"{r['peak_mb']:.0f} ({base['peak_mb']:.0f})" if base else f"{r['peak_mb']:.0f}"
            print(f"| {model} | {batch} | {precision} | {label} | {r['ms']:.2f} ({r['iqr_ms']:.2f}) | {ratio} "
                  f"| {peak} | {r['setup_s']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())

"""The ``concur`` command: ``inspect`` a model's plan, run the ``demo``, write a ``report``, clear the tuner ``cache``."""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Sequence

import torch

from . import api
from .cost import ROOFLINES, AnalyticCost
from .timing import time_cuda_ms
from .zoo import build_model


def _example(args: argparse.Namespace, device: str) -> tuple[torch.Tensor]:
    return (torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device),)


def _plan_summary(cm: api.ConcurModule) -> str:
    s = cm.schedule
    per_stream = [len(s.nodes_on(i)) for i in range(s.num_streams)]
    return (f"scheduler {s.scheduler}: {len(s.order)} ops on {s.num_streams} streams "
            f"(ops per stream {per_stream}), {len(s.waits)} cross-stream waits, "
            f"predicted makespan {s.makespan:,.1f} us")


def cmd_inspect(args: argparse.Namespace) -> int:
    model = build_model(args.model).train(not args.eval)
    example = _example(args, "cpu")
    cost = AnalyticCost(ROOFLINES[args.profile])
    print(api.inspect(model, example, scheduler=args.scheduler, cost_model=cost))
    cm = api.optimize(model, example, streams=args.streams, scheduler=args.scheduler, cost_model=cost)
    print(_plan_summary(cm))
    return 0


def _max_rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _gradients(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cmd_demo(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.allow_tf32 = False  # the check compares fp32 results, not TF32 noise
    torch.manual_seed(0)
    model = build_model(args.model).train().to(device)
    reference, serial_copy = copy.deepcopy(model), copy.deepcopy(model)
    example = _example(args, device)
    cost = AnalyticCost(ROOFLINES["h100"]) if device == "cpu" else None
    print(f"concur demo: {args.model}, batch {args.batch_size}, {args.image_size}x{args.image_size}, on {device}")
    print(api.inspect(model, example, cost_model=cost))
    cm = api.optimize(model, example, streams=args.streams, cost_model=cost)
    serial = api.optimize(serial_copy, example, streams=1, cost_model=cost)
    print(_plan_summary(cm))

    x = _example(args, device)[0]
    out_ref, g_ref = _gradients(reference, x)
    out_one, g_one = _gradients(serial, x)
    out, g = _gradients(cm, x)
    out_err, grad_err, reorder_err = _max_rel_error(out, out_ref), _max_rel_error(g, g_ref), \
        _max_rel_error(g_one, g_ref)
    # Reordering alone changes the order autograd sums branch gradients in; concurrency must add nothing.
    ok = out_err < 1e-5 and grad_err <= max(1e-5, 4 * reorder_err)
    print(f"check against the original model: output rel. error {out_err:.2e}, gradient rel. error "
          f"{grad_err:.2e} (same plan on one stream: {reorder_err:.2e}) -> {'OK' if ok else 'MISMATCH'}")
    if device == "cuda":
        torch.backends.cudnn.allow_tf32 = True
        from .train import train_step

        y = torch.randint(0, 1000, (args.batch_size,), device=device)
        loss_fn = torch.nn.CrossEntropyLoss()
        for label, streams in (("serial CUDA graph", 1), (f"concur CUDA graph, {args.streams} streams", args.streams)):
            m = copy.deepcopy(reference)
            step = train_step(m, loss_fn, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), (x, y),
                              streams=streams)
            print(f"training step, {label}: {time_cuda_ms(lambda: step(x, y))[0]:.2f} ms")
    else:
        print("no GPU here: the plan ran in its issue order on the CPU; timings need CUDA.")
    return 0 if ok else 1


def cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    path = write_report(args.run_dir, args.out)
    print(f"report written: {path} (numbers in {path.parent / 'report.json'})")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from .tune_cache import TunerCache

    cache = TunerCache(args.dir)
    if args.action == "clear":
        print(f"removed {cache.clear()} cached tuner choice(s) from {cache.path}")
    else:
        entries = cache.entries()
        print(f"{len(entries)} cached tuner choice(s) in {cache.path}")
        for e in entries:
            print(f"  {e.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="concur", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", nargs="?", default="torchvision:googlenet",
                        help="torchvision:NAME or module:factory (default torchvision:googlenet)")
    common.add_argument("--batch-size", type=int, default=4)
    common.add_argument("--image-size", type=int, default=64)
    common.add_argument("--streams", type=int, default=4)
    insp = sub.add_parser("inspect", parents=[common], help="print the DAG, critical path and plan")
    insp.add_argument("--scheduler", default="critical_path")
    insp.add_argument("--profile", default="h100", choices=sorted(ROOFLINES),
                      help="device whose roofline predicts op times (default h100)")
    insp.add_argument("--eval", action="store_true", help="trace in eval mode")
    insp.set_defaults(func=cmd_inspect)
    demo = sub.add_parser("demo", parents=[common], help="trace, schedule, check and (on a GPU) time a model")
    demo.set_defaults(func=cmd_demo)
    rep = sub.add_parser("report", help="turn a run directory into one HTML page, PNG plots and JSON")
    rep.add_argument("run_dir", help="directory holding run.json (written by an experiment)")
    rep.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    rep.set_defaults(func=cmd_report)
    cache = sub.add_parser("cache", help="list or clear the tuner's cached choices (streams='auto')")
    cache.add_argument("action", choices=["clear", "list"])
    cache.add_argument("--dir", default=None, help="cache directory (default $CONCUR_CACHE_DIR or ~/.cache/concur)")
    cache.set_defaults(func=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

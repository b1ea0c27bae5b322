"""The ``concur`` command: ``inspect`` a model's plan, or run the ``demo``."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Sequence

import torch

from . import api
from .cost import ROOFLINES, AnalyticCost
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


def _time_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cmd_demo(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_model(args.model).train().to(device)
    reference = copy.deepcopy(model)
    example = _example(args, device)
    profile = "h100" if device == "cpu" else None
    cost = AnalyticCost(ROOFLINES[profile]) if profile else None
    print(f"concur demo: {args.model}, batch {args.batch_size}, {args.image_size}x{args.image_size}, on {device}")
    print(api.inspect(model, example, cost_model=cost) if cost else api.inspect(model, example))
    cm = api.optimize(model, example, streams=args.streams, cost_model=cost)
    print(_plan_summary(cm))

    x = _example(args, device)[0]
    torch.manual_seed(1)
    out_ref = reference(x)
    torch.manual_seed(1)
    out = cm(x)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    out_err = _max_rel_error(out, out_ref)
    grads = torch.cat([p.grad.flatten() for p in cm.parameters() if p.grad is not None])
    ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None])
    grad_err = _max_rel_error(grads, ref_grads)
    ok = out_err < 1e-5 and grad_err < 1e-5
    print(f"check against the original model: output rel. error {out_err:.2e}, "
          f"gradient rel. error {grad_err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    if device == "cuda":
        serial = api.optimize(reference, example, streams=1)
        for name, m in (("serial (1 stream)", serial), (f"concur ({cm.schedule.num_streams} streams)", cm)):
            print(f"eager forward+backward, {name}: "
                  f"{_time_ms(lambda: m(x).square().mean().backward()):.2f} ms")
    else:
        print("no GPU here: the plan ran in its issue order on the CPU; timings need CUDA.")
    return 0 if ok else 1


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

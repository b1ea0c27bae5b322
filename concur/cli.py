"""The ``concur`` command: ``inspect`` a model's plan, run the ``demo``, write a ``report``, list or clear the ``cache``.

A mistake on the command line (an unknown model, a model file that fails to
import, an input the model cannot take, a missing run directory) prints one
line saying what to do and exits with 2; ``--debug`` shows the traceback
instead.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Sequence

import torch

import schedulers

from concur.dag.cost import ROOFLINES, AnalyticCost, describe, roofline_for
from concur.errors import CaptureError, ConcurError, ExampleInputError, PlanError
from concur.fx import module as api
from concur.observe.timing import time_cuda_ms
from concur.zoo import ModelSpecError, ZooModel, load

USAGE_ERROR = 2  # argparse's own exit code for a bad command line
AUTO = "auto"
NO_GPU_DEVICE = "h100"  # what --device auto models without a GPU: the device concur's numbers were measured on
INSPECTED_STREAMS = 8  # inspect predicts 1..8 streams (more when --streams asks for more)


class UsageError(ValueError):
    """The command line asks for something that cannot work; the message says what to do instead."""


def device_model(choice: str) -> tuple[AnalyticCost, str]:
    """Return the cost model ``--device`` selects and a note on how ``auto`` chose it ('' otherwise)."""
    if choice != AUTO:
        return AnalyticCost(ROOFLINES[choice]), ""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return AnalyticCost(roofline_for(name)), f"--device auto: this machine's {name}"
    return AnalyticCost(ROOFLINES[NO_GPU_DEVICE]), \
        f"--device auto: no GPU here, so an {NO_GPU_DEVICE.upper()}; --device picks another"


def _model(args: argparse.Namespace) -> ZooModel:
    """Build the model and settle ``args.image_size`` (the model's own size unless given or ``--input-shape`` is)."""
    zoo = load(args.model)
    if args.input_shape is None:
        if args.image_size is None:
            args.image_size = zoo.image_size
        zoo.check_image_size(args.image_size)
    return zoo


def _sample_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """Return one example's shape, without the batch: ``--input-shape``, else 3 x size x size."""
    return args.input_shape or (3, args.image_size, args.image_size)


def _input_text(args: argparse.Namespace) -> str:
    """Return the example input as the first line of ``inspect`` and ``demo`` names it."""
    if args.input_shape is None:
        return f"{args.image_size}x{args.image_size}"
    return f"input {'x'.join(map(str, args.input_shape))}"


def _example(args: argparse.Namespace, device: str) -> tuple[torch.Tensor]:
    return (torch.randn(args.batch_size, *_sample_shape(args), device=device),)


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _analysed(args: argparse.Namespace, zoo: ZooModel, what, *call_args, **kwargs):
    """Run ``what`` (inspect or optimize) on the model; a failure of the model itself becomes one line.

    concur raises :class:`ExampleInputError` only where the model itself, run
    eagerly, fails on the input: the input the command line asked for is
    wrong (exit 2, naming the option that fixes it). Any other failure is
    not the input's (exit 1).
    """
    try:
        return what(*call_args, **kwargs)
    except (CaptureError, PlanError):
        raise
    except Exception as exc:
        root = getattr(exc, "original", None) or _root_cause(exc)
        shape = "x".join(map(str, (args.batch_size, *_sample_shape(args))))
        failure = f"{args.model} failed on a {shape} input: {type(root).__name__}: {_first_line(root)}"
        if not isinstance(exc, ExampleInputError):
            raise RuntimeError(failure) from exc
        if args.input_shape is not None:
            raise UsageError(f"{failure}; check --input-shape, the shape of one sample without the batch") from exc
        if zoo.size_known and args.image_size != zoo.image_size:
            raise UsageError(f"{failure}; try its own size, --image-size {zoo.image_size}") from exc
        raise UsageError(f"{failure}; give the shape of one sample it takes with --input-shape "
                         f"(e.g. --input-shape 1,28,28; the batch is prepended)") from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _plan_summary(cm: api.ConcurModule, device_line: str) -> str:
    s = cm.schedule
    per_stream = [len(s.nodes_on(i)) for i in range(s.num_streams)]
    return (f"scheduler {s.scheduler}: {len(s.order)} ops on {s.num_streams} streams "
            f"(ops per stream {per_stream}), {len(s.waits)} cross-stream waits, "
            f"predicted makespan {s.makespan:,.1f} us on the {device_line}")


def faster_streams(predicted: dict[int, float], asked: int) -> str:
    """Return a line naming the stream count predicted fastest when it is not ``asked`` ('' when it is).

    Speedups are compared as printed (two decimals), so a tie on the page is no
    advice; among equals the fewest streams win.
    """
    shown = {k: round(v, 2) for k, v in predicted.items()}
    best = max(sorted(shown), key=lambda k: shown[k])
    if asked not in shown or shown[best] <= shown[asked]:
        return ""
    return (f"{best} streams are predicted faster than the {asked} asked for ({shown[best]:.2f}x against "
            f"{shown[asked]:.2f}x): try --streams {best}")


def cmd_inspect(args: argparse.Namespace) -> int:
    zoo = _model(args)
    model = zoo.model.train(not args.eval)
    example = _example(args, "cpu")
    cost, note = device_model(args.device)
    print(f"{args.model}, batch {args.batch_size}, {_input_text(args)}, "
          f"{'eval' if args.eval else 'train'} mode{'; ' + note if note else ''}")
    inspection = _analysed(args, zoo, api.inspect, model, example, scheduler=args.scheduler, cost_model=cost,
                           max_streams=max(INSPECTED_STREAMS, args.streams))
    print(inspection)
    cm = _analysed(args, zoo, api.optimize, model, example, streams=args.streams, scheduler=args.scheduler,
                   cost_model=cost)
    print(_plan_summary(cm, describe(cost)))
    advice = faster_streams(inspection.calibrated_speedup or inspection.predicted_speedup, args.streams)
    if advice:
        print(advice)
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
    zoo = _model(args)
    model = zoo.model.train().to(device)
    reference, serial_copy = copy.deepcopy(model), copy.deepcopy(model)
    example = _example(args, device)
    cost, note = device_model(args.device)
    print(f"concur demo: {args.model}, batch {args.batch_size}, {_input_text(args)}, on {device}"
          f"{'; ' + note if note else ''}")
    print(_analysed(args, zoo, api.inspect, model, example, scheduler=args.scheduler, cost_model=cost))
    cm = _analysed(args, zoo, api.optimize, model, example, streams=args.streams, scheduler=args.scheduler,
                   cost_model=cost)
    serial = api.optimize(serial_copy, example, streams=1, scheduler=args.scheduler, cost_model=cost)
    print(_plan_summary(cm, describe(cost)))

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
        from concur.training.step import train_step

        # the check's loss (the output's mean square), so that any model's output fits it, not only 1000 classes
        y = torch.zeros_like(out_ref)
        loss_fn = torch.nn.MSELoss()
        for label, streams in (("serial CUDA graph", 1), (f"concur CUDA graph, {args.streams} streams", args.streams)):
            m = copy.deepcopy(reference)
            step = train_step(m, loss_fn, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), (x, y),
                              streams=streams, scheduler=args.scheduler)
            print(f"training step, {label}: {time_cuda_ms(lambda: step(x, y))[0]:.2f} ms ({step.status})")
    else:
        print("no GPU here: the plan ran in its issue order on the CPU; timings need CUDA.")
    return 0 if ok else 1


def cmd_report(args: argparse.Namespace) -> int:
    from concur.observe.report import write_report

    run_dir = Path(args.run_dir)
    wrong = ("does not exist" if not run_dir.exists() else "is not a directory" if not run_dir.is_dir() else
             "holds no run.json" if not (run_dir / "run.json").is_file() else "")
    if wrong:
        raise UsageError(f"{args.run_dir} {wrong}: pass the directory an experiment wrote "
                         "(e.g. experiments/results/<run>/tuner/<case>)")
    path = write_report(args.run_dir, args.out)
    print(f"report written: {path} (numbers in {path.parent / 'report.json'})")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from concur.dag.disk_cache import JsonCache
    from concur.observe.tune_cache import TunerCache

    # both caches a later run reads instead of measuring again: the tuner's choices and the stream decisions
    caches = (("cached tuner choice(s)", TunerCache(args.dir)), ("measured stream decision(s)", JsonCache(args.dir)))
    for what, cache in caches:
        if args.action == "clear":
            print(f"removed {cache.clear()} {what} from {cache.path}")
        else:
            entries = cache.entries()
            print(f"{len(entries)} {what} in {cache.path}")
            for e in entries:
                print(f"  {e.name}{_measured(cache.get(e.stem))}")
    return 0


def _measured(result: dict | None) -> str:
    """What a measured decision says, for ``concur cache list``: kept or dropped, and the times it rests on.

    A decision timed beside other work on the GPU can be wrong and is read
    back by every later run; this line is how a user finds it.
    """
    if not isinstance(result, dict):
        return ""
    try:
        one, streams = float(result["one_stream_ms"]), float(result["streams_ms"])
        predicted = float(result["predicted_speedup"])
    except (KeyError, TypeError, ValueError):
        return ""  # the tuner's entries, or one written by another version: the file's name alone
    if one <= 0 or streams <= 0:
        return ""
    kept = "kept" if result.get("keep") else "dropped"
    others = result.get("other_processes")
    beside = f"; timed beside {others} other process(es) on the GPU, not reused" if others else ""
    return (f": {result.get('what', 'a graph')}: {kept} {result.get('num_streams', '?')} streams, measured "
            f"{one / streams:.2f}x ({one:.3f} ms on one stream, {streams:.3f} ms on streams, "
            f"{result.get('rounds', '?')} rounds), predicted {predicted:.2f}x{beside}")


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value
    return parse


def _shape(text: str) -> tuple[int, ...]:
    """Parse ``--input-shape``: whole numbers >= 1 separated by commas (or x), e.g. ``1,28,28``."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape: give whole numbers separated by commas, "
                                         "e.g. 1,28,28") from None
    if not all(1 <= d <= 1 << 16 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r} has a size not in 1..{1 << 16}")
    return shape


def _plain(doc: str) -> str:
    """Return a docstring as terminal text: reStructuredText's ``literal`` marks dropped."""
    return doc.replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="concur", description=_plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true",
                       help="show the full traceback of an error instead of one line (default: off)")
    common = argparse.ArgumentParser(add_help=False, parents=[debug])
    common.add_argument("model", nargs="?", default="torchvision:googlenet",
                        help="torchvision:NAME, timm:NAME (needs timm) or my.module:make_model, a function "
                             "taking no arguments, imported as python -m would (my.module in the current folder "
                             "or on PYTHONPATH; my_file.py:make_model also works) (default: %(default)s)")
    common.add_argument("--batch-size", type=_int_in(1, 1 << 16), default=8, metavar="N",
                        help="batch of the example input (default: %(default)s)")
    size = common.add_mutually_exclusive_group()
    size.add_argument("--image-size", type=_int_in(1, 1 << 14), default=None, metavar="PX",
                      help="side of the square 3-channel example input (default: the model's own: 224 for most "
                           "torchvision models, 299 for inception_v3, timm's input_size; 224 for my.module:NAME)")
    size.add_argument("--input-shape", type=_shape, default=None, metavar="D,D,...",
                      help="shape of one example input without the batch, which is prepended: 1,28,28 for "
                           "one-channel 28x28 images, 16 for 16 features; a random float tensor (default: "
                           "3,PX,PX from --image-size)")
    common.add_argument("--streams", type=_int_in(1, 64), default=4, metavar="N",
                        help="CUDA streams the plan may use (default: %(default)s)")
    common.add_argument("--scheduler", default="critical_path", choices=sorted(schedulers.SCHEDULERS),
                        help="how ops are placed on streams (default: %(default)s)")
    common.add_argument("--device", default=AUTO, choices=[AUTO, *ROOFLINES],
                        help="device whose roofline predicts op times, hence the plan and the predicted "
                             f"speedup (default: %(default)s: this machine's GPU, or {NO_GPU_DEVICE} "
                             "without one)")
    insp = sub.add_parser("inspect", parents=[common],
                          help="print a summary of the model's DAG, its predicted speedups and plan",
                          description="Trace the model on the CPU and print a summary of its DAG (operations, "
                                      "width, serial time, critical path), the predicted speedup for 1 to 8 "
                                      "streams (or up to --streams), and the plan for --streams, for the "
                                      "device --device names; "
                                      "and which stream count is predicted fastest when it is not --streams. "
                                      "The DAG itself is not printed: concur.inspect and "
                                      "concur.optimize(...).plan give it in Python.")
    insp.add_argument("--eval", action="store_true", help="trace in eval mode (default: train mode)")
    insp.set_defaults(func=cmd_inspect)
    demo = sub.add_parser("demo", parents=[common], help="trace, schedule, check and (on a GPU) time a model",
                          description="Trace and schedule the model, check outputs and gradients against the "
                                      "original, and on a GPU time serial against concurrent training steps.")
    demo.set_defaults(func=cmd_demo)
    rep = sub.add_parser("report", parents=[debug],
                         help="turn a run directory into one HTML page, PNG plots and JSON",
                         description="Read RUN_DIR/run.json, written by an experiment, and write one HTML page, "
                                     "PNG plots and report.json into --out.")
    rep.add_argument("run_dir", help="directory holding run.json (written by an experiment); required")
    rep.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report)")
    rep.set_defaults(func=cmd_report)
    cache = sub.add_parser("cache", parents=[debug],
                           help="list or clear the tuner's choices and the stream decisions later runs reuse",
                           description="List or clear what later runs read instead of measuring again: the "
                                       "tuner's choices (concur.observe.tuner) and the measured stream decisions, "
                                       "each listed with the times it rests on.")
    cache.add_argument("action", choices=["clear", "list"], help="what to do with the cache; required")
    cache.add_argument("--dir", default=None,
                       help="cache directory (default: $CONCUR_CACHE_DIR, else ~/.cache/concur)")
    cache.set_defaults(func=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv``; return the exit code (2 for a usage error, 1 for a failure)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ModelSpecError) as exc:
        if args.debug:
            raise
        print(f"concur {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as exc:
        if args.debug or isinstance(exc, PlanError):
            raise  # a concur bug (PlanError asks for a report): the traceback is what to send
        # concur's own errors are written to be read whole (what, where, the fix); others by their first line
        message = str(exc).strip() if isinstance(exc, ConcurError) else _first_line(exc)
        print(f"concur {args.command}: {type(exc).__name__}: {message} (--debug shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

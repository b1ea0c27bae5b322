"""What the measured keep-or-drop decision does on a GPU: per graph, predicted against measured, and its setup cost.

For each model, ``train_step`` is set up twice in this process with an empty
decision cache (``$CONCUR_CACHE_DIR``): the first setup times every plan the
prediction lets through, the second must read the cache and time nothing.
Printed per graph: route, predicted speedup, measured speedup, streams kept;
per setup: seconds in all and seconds spent timing (issue 29 asks for at most
10% of setup).

    python experiments/decision_check.py --models torchvision:googlenet torchvision:resnet50 --batch 32
    python experiments/decision_check.py --unfused --models torchvision:googlenet --batch 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import concur  # noqa: E402
import concur.dag.measure as measure  # noqa: E402
import concur.fx.decision as fx_decision  # noqa: E402
from concur.zoo import load  # noqa: E402

timed_s: list[float] = []


def _counting(real):
    def replays(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            timed_s.append(time.perf_counter() - t0)
    return replays


def loss(out, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the main output (GoogLeNet and Inception-v3 add auxiliary ones in training)."""
    return F.cross_entropy(out[0] if isinstance(out, tuple) else out, y)


def setup(spec: str, batch: int, compiled: bool) -> tuple[float, float, list]:
    zoo = load(spec)
    model, size = zoo.model, zoo.image_size
    model = model.cuda().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    timed_s.clear()
    torch._dynamo.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step = concur.train_step(model, loss, optimizer, (x, y), compile=compiled, amp_dtype=torch.bfloat16)
    step(x, y)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    graphs = list(step.backends[4].graphs) if compiled else []
    return seconds, sum(timed_s), graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["torchvision:googlenet", "torchvision:resnet50"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--unfused", action="store_true", help="the fx path (optimize) instead of compile=True")
    args = parser.parse_args()
    os.environ["CONCUR_CACHE_DIR"] = tempfile.mkdtemp(prefix="concur-decisions-")
    measure.alternating_replays = _counting(measure.alternating_replays)
    fx_decision.alternating_replays = measure.alternating_replays
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cache {os.environ['CONCUR_CACHE_DIR']}")
    for spec in args.models:
        for attempt in ("first", "cached"):
            seconds, timing, graphs = setup(spec, args.batch, not args.unfused)
            print(f"{spec} b{args.batch} {attempt}: setup {seconds:.1f} s, timing {timing:.2f} s "
                  f"({100 * timing / seconds:.1f}%)")
            for g in graphs:
                measured = f"{g.measured_speedup:.3f}x" if g.measured_speedup else "-"
                print(f"  {'bw' if g.is_backward else 'fw'} launches {g.num_launches:4d} predicted "
                      f"{g.predicted_speedup:.3f}x measured {measured} -> {g.num_streams} stream(s) "
                      f"[{g.decided_by or 'no decision'}] {g.one_stream_reason or ''}"[:200])


if __name__ == "__main__":
    main()

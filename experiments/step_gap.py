"""Where concur's one-stream step loses time against PyTorch's recipe (experiments/peers.py), measured apart.

    PYTHONPATH=. python experiments/step_gap.py --model resnet50 --batch 8 [--compile] [--json out.jsonl]

In one process, timed in alternating rounds with CUDA events after warm-up:

    recipe          the peer's whole call (input copies, replay, loss clone)
    recipe replay   its graph alone, replayed back to back
    concur          ``train_step(streams=1)``'s whole call
    concur replay   its graph alone
    concur np       the same step captured on an ordinary stream (``stream_priority=False``)

The replay rows separate the graph's content from the Python around it; the
host column is the Python time of one call while the device is busy (calls
return before their kernels finish). A profile of a few calls of each step
then sums kernel time per name, so a kernel that runs slower in one graph
shows by name, and ``busy`` against the step time shows idle device time.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn
import torchvision

from experiments import peers

# concur is imported inside the functions that run it: setup() also builds the model for processes that must
# not load concur at all (experiments/memory.py's recipe side).


def _model(name: str) -> tuple[nn.Module, int]:
    if name == "hrnet_w18_small":
        try:
            import timm
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(f"timm not installed: {name} is a timm model (pip install timm)") from exc
        return timm.create_model(name, pretrained=False), 224
    kwargs = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
    return getattr(torchvision.models, name)(**kwargs), 299 if name == "inception_v3" else 224


def setup(name: str, batch_size: int) -> tuple[nn.Module, tuple, nn.Module, Callable]:
    """The runs' common ground: a seeded channels-last model on the GPU, a batch, the loss and the optimizer."""
    torch.manual_seed(0)
    model, size = _model(name)
    model = model.cuda().to(memory_format=torch.channels_last).train()
    batch = (torch.randn(batch_size, 3, size, size, device="cuda").to(memory_format=torch.channels_last),
             torch.randint(0, 1000, (batch_size,), device="cuda"))
    optimizer = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    return model, batch, nn.CrossEntropyLoss(), optimizer


def _time(fns: dict, rounds: int, steps: int) -> dict:
    """Median ms per call of each function, over alternating rounds of ``steps`` back-to-back calls."""
    from concur.observe.timing import cuda_block_ms

    times = collections.defaultdict(list)
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(cuda_block_ms(fn, warmup=1, steps=steps))
    return {name: statistics.median(v) for name, v in times.items()}


def _host_us(fn, calls: int = 10) -> float:
    """Python time of one call with the device busy: the calls queue faster than they run unless the host is slower."""
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the device busy for the whole measurement
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _kernel_time(fn, calls: int = 5) -> collections.Counter:
    """Kernel microseconds per call, by kernel name."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_name = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name[:80]] += e.device_time / calls
    return per_name


def main() -> None:
    import concur

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, batch, loss_fn, opt = setup(args.model, args.batch)
    make_peer = peers.compile_graph_step if args.compile else peers.eager_graph_step
    peer = make_peer(copy.deepcopy(model), loss_fn, opt, batch, amp_dtype=torch.bfloat16)
    steps = {}
    for name, priority in (("concur", True), ("concur np", False)):
        m = copy.deepcopy(model)
        steps[name] = concur.train_step(m, loss_fn, opt(m.parameters()), batch, streams=1,
                                        amp_dtype=torch.bfloat16, compile=args.compile, stream_priority=priority)
        steps[name](*batch)
    graph = next(iter(steps["concur"].graphs.values())).graph
    fns = {"recipe": lambda: peer(*batch), "recipe replay": peer.graph.replay,
           "concur": lambda: steps["concur"](*batch), "concur replay": graph.replay,
           "concur np": lambda: steps["concur np"](*batch)}
    ms = _time(fns, args.rounds, args.steps)
    host = {name: _host_us(fns[name]) for name in ("recipe", "concur")}
    kernels = {name: _kernel_time(fns[name]) for name in ("recipe", "concur")}
    label = f"{args.model} b{args.batch} {'compiled' if args.compile else 'eager'}"
    print(f"\n{label}: ms per call (median of {args.rounds} alternating rounds of {args.steps})")
    for name, t in ms.items():
        print(f"  {name:14s} {t:7.3f} ms  {ms['recipe'] / t:6.3f}x of the recipe"
              + (f"   host {host[name]:7.1f} us/call" if name in host else ""))
    busy = {name: sum(k.values()) / 1e3 for name, k in kernels.items()}
    print(f"  kernel busy ms per call: recipe {busy['recipe']:.3f}, concur {busy['concur']:.3f}")
    diff = kernels["concur"].copy()
    diff.subtract(kernels["recipe"])
    for kname, us in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]:
        print(f"  {us:+8.1f} us  {kname}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"label": label, "ms": ms, "host_us": host, "busy_ms": busy,
                                "kernel_diff_us": dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:30])})
                    + "\n")


if __name__ == "__main__":
    main()

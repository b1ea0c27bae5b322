"""Which CUDA kernels one replay of concur's one-stream step launches beyond PyTorch's recipe (experiments/peers.py).

    PYTHONPATH=. python experiments/kernel_diff.py --model resnet50 --batch 8 [--compile] [--options '{"split_weight_grads": false}']

Prints the kernel counts and the kernel names (by count) that one side launches more often than the other.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json

import torch
import torch.nn as nn
import torchvision

import concur
from experiments import peers


def kernels(step, batch) -> collections.Counter:
    for _ in range(2):
        step(*batch)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(*batch)
        torch.cuda.synchronize()
    return collections.Counter(e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--options", default=None, help="compile_options as JSON")
    ap.add_argument("--no-priority", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(**({"aux_logits": False, "init_weights": False}
                                                      if args.model == "inception_v3" else {}))
    model = model.cuda().to(memory_format=torch.channels_last).train()
    size = 299 if args.model == "inception_v3" else 224
    batch = (torch.randn(args.batch, 3, size, size, device="cuda").to(memory_format=torch.channels_last),
             torch.randint(0, 1000, (args.batch,), device="cuda"))
    loss_fn = nn.CrossEntropyLoss()
    opt = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    make_peer = peers.compile_graph_step if args.compile else peers.eager_graph_step
    theirs = kernels(make_peer(a, loss_fn, opt, batch, amp_dtype=torch.bfloat16), batch)
    options = json.loads(args.options) if args.options else None
    mine = kernels(concur.train_step(b, loss_fn, opt(b.parameters()), batch, streams=1, amp_dtype=torch.bfloat16,
                                     compile=args.compile, compile_options=options,
                                     stream_priority=not args.no_priority), batch)
    label = f"{args.model} b{args.batch} {'compiled' if args.compile else 'eager'} options={options}"
    print(f"{label}: recipe {sum(theirs.values())} kernels, concur streams=1 {sum(mine.values())}")
    for name, n in (mine - theirs).most_common(12):
        print(f"  concur +{n}: {name}")
    for name, n in (theirs - mine).most_common(12):
        print(f"  recipe +{n}: {name}")


if __name__ == "__main__":
    main()

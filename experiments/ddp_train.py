"""Data-parallel training of a concur-optimized model with DistributedDataParallel.

    torchrun --nproc-per-node=2 experiments/ddp_train.py --steps 20
    torchrun --nproc-per-node=8 experiments/ddp_train.py --model torchvision:inception_v3 --image-size 75
    torchrun --nproc-per-node=2 experiments/ddp_train.py --cuda-graph --compare   # GPUs only

NCCL on GPUs (one per process, LOCAL_RANK), gloo on CPU. Synthetic data, different
on every rank. The pattern is:

    cm = concur.optimize(model, (example_x,), streams=4)   # before DDP, before any forward
    ddp = DistributedDataParallel(cm, device_ids=[local_rank])
    optimizer = SGD(model.parameters(), ...)               # cm shares model's parameters

``--compare`` also trains plain DDP from the same initialisation on the same data
and prints the largest relative parameter difference at the end. ``--cuda-graph``
captures the whole step (forward, backward with DDP's all-reduce, optimizer)
following PyTorch's rules for DDP: DDP built on a side stream, 11 eager
warm-up steps, capture on that stream.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import concur  # noqa: E402
from concur.zoo import build_model  # noqa: E402

WARMUP = 11  # DDP needs at least 11 eager iterations before a CUDA graph capture


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="torchvision:googlenet",
                   help="torchvision:NAME or module:factory (default torchvision:googlenet)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--cuda-graph", action="store_true", help="capture the whole step (GPU only)")
    p.add_argument("--compare", action="store_true", help="also train plain DDP and compare")
    return p.parse_args(argv)


def batch(step: int, rank: int, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    return x.to(device), torch.randint(0, 10, (args.batch_size,), generator=g).to(device)


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def run(args, use_concur: bool, rank: int, device: torch.device,
        perturb: float = 0.0) -> tuple[torch.nn.Module, list[float], float]:
    """Train one model; return it, its losses, and the mean step time in ms after warm-up.

    ``perturb`` scales every initial parameter by (1 + perturb * noise): the
    training's own sensitivity to rounding, against which concur's different
    (but equally valid) summation orders are judged.
    """
    torch.manual_seed(0)
    model = build_model(args.model).to(device).train()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + perturb * torch.randn_like(p))
    module = model
    if use_concur:
        module = concur.optimize(model, (batch(0, rank, args, device)[0],), streams=args.streams)
    stream = torch.cuda.Stream(device) if args.cuda_graph else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        loss = F.cross_entropy(logits_of(ddp(x)), y)
        loss.backward()
        opt.step()
        return loss

    # Reseed after tracing (which runs the model once): both runs draw the same dropout masks.
    torch.manual_seed(1 + rank)
    losses, times = [], []
    eager_steps = min(WARMUP, args.steps) if args.cuda_graph else args.steps
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        for i in range(eager_steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            losses.append(step(*batch(i, rank, args, device)).item())  # .item() syncs: wall time is the step's
            times.append(time.perf_counter() - t0)
    if args.cuda_graph and args.steps > WARMUP:
        torch.cuda.current_stream(device).wait_stream(stream)
        static_x, static_y = batch(WARMUP, rank, args, device)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph, stream=stream):
            static_loss = step(static_x, static_y)
        times = []
        for i in range(WARMUP, args.steps):
            x, y = batch(i, rank, args, device)
            t0 = time.perf_counter()
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            losses.append(static_loss.item())
            times.append(time.perf_counter() - t0)
    measured = times[len(times) // 2:] or times
    return model, losses, 1000 * sum(measured) / len(measured)


def relative_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    va = torch.cat([p.detach().flatten() for p in a.parameters()])
    vb = torch.cat([p.detach().flatten() for p in b.parameters()])
    return ((va - vb).norm() / vb.norm()).item()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.cuda_graph and not cuda:
        sys.exit("--cuda-graph needs GPUs")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model, losses, ms = run(args, True, rank, device)
        if rank == 0:
            print(f"{args.model}: concur ({args.streams} streams) + DDP, {world} processes, "
                  f"batch {args.batch_size}/process, {'CUDA graph' if args.cuda_graph else 'eager'}")
            for i, loss in enumerate(losses):
                print(f"step {i:3d}  loss {loss:.4f}")
            print(f"step time {ms:.2f} ms (rank 0, mean of the last half of the steps)")
        if args.compare:
            plain, plain_losses, plain_ms = run(args, False, rank, device)
            nudged, nudged_losses, _ = run(args, False, rank, device, perturb=1e-7)
            if rank == 0:
                print(f"plain DDP step time {plain_ms:.2f} ms")
                print("difference from plain DDP       first loss   largest loss   parameters (relative)")
                for name, m, ls in (("concur", model, losses), ("plain, init nudged by 1e-7", nudged, nudged_losses)):
                    first = abs(ls[0] - plain_losses[0])
                    largest = max(abs(a - b) for a, b in zip(ls, plain_losses))
                    print(f"{name:<30} {first:10.2e} {largest:14.2e} {relative_difference(m, plain):16.2e}")
                print("(the nudged run is the training's own sensitivity to rounding: "
                      "concur should be no further from plain than it)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

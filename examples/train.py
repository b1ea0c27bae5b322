"""A complete training script with concur.train_step: the loop you would write anyway, one line changed.

DataLoader, OneCycleLR, gradient clipping, bf16 autocast, validation every
epoch, a checkpoint every epoch and resuming from it. On a GPU each step is
one replay of a CUDA graph with the model's branches on 4 streams; on CPU the
same code runs eagerly.

    python examples/train.py                         # GPU if there is one
    python examples/train.py --small --epochs 2      # CPU in seconds (CI runs this): val acc > 0.9, chance 0.08
    python examples/train.py --stop-after 3          # as if interrupted after epoch 3, then:
    python examples/train.py --resume runs/train/ckpt.pt   # go on from the last checkpoint

The data are synthetic (no download): images whose class is the quadrant
and colour channel holding a bright patch, so the accuracy shows learning.
The checkpoint goes to runs/train/ckpt.pt (git ignores runs/) unless
--checkpoint says otherwise. It holds the random number generators' states
too, so a resumed run shuffles its batches as the uninterrupted run would.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import concur


def conv_bn(cin: int, cout: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class Inception(nn.Module):
    """Four parallel branches, concatenated: the independent work concur puts on streams."""

    def __init__(self, cin: int, width: int):
        super().__init__()
        self.b1 = conv_bn(cin, width, 1)
        self.b3 = nn.Sequential(conv_bn(cin, width, 1), conv_bn(width, width, 3))
        self.b5 = nn.Sequential(conv_bn(cin, width, 1), conv_bn(width, width, 3), conv_bn(width, width, 3))
        self.pool = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), conv_bn(cin, width, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)], dim=1)


class Net(nn.Module):
    def __init__(self, width: int = 16, classes: int = 12):
        super().__init__()
        self.stem = conv_bn(3, width, 3)
        self.block1 = Inception(width, width)
        self.block2 = Inception(4 * width, width)
        self.head = nn.Linear(4 * width * 4, classes)

    def forward(self, x):
        x = self.block2(nn.functional.max_pool2d(self.block1(self.stem(x)), 2))
        # pooled to 2x2, not to one value per channel: the class depends on where the patch is
        return self.head(nn.functional.adaptive_avg_pool2d(x, 2).flatten(1))


def synthetic(n: int, size: int, seed: int) -> TensorDataset:
    """Noise plus a bright patch; class = 4 * channel + quadrant of the patch."""
    g = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, 12, (n,), generator=g)
    half = size // 2
    for i, label in enumerate(y.tolist()):
        channel, quadrant = divmod(label, 4)
        r, c = divmod(quadrant, 2)
        x[i, channel, r * half:(r + 1) * half, c * half:(c + 1) * half] += 1.5
    return TensorDataset(x, y)


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, amp: torch.dtype | None) -> tuple[float, float]:
    """Mean loss and accuracy on ``loader``, in eval mode (BatchNorm's running statistics)."""
    model.eval()
    total, correct, loss = 0, 0, 0.0
    autocast = torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
    with torch.inference_mode(), autocast:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x).float()
            loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return loss / total, correct / total


DEFAULT_CHECKPOINT = os.path.join("runs", "train", "ckpt.pt")  # runs/ is git-ignored


def _seconds(t: float) -> str:
    return f"{t:.1f} s" if t >= 1 else f"{t * 1000:.0f} ms"


def _rng_state(loader_rng: torch.Generator) -> dict:
    """The generators a resumed run must continue: the shuffle's, torch's (dropout, init) and CUDA's."""
    return {"loader": loader_rng.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict, loader_rng: torch.Generator) -> None:
    loader_rng.set_state(state["loader"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="epochs of the one-cycle schedule (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=48, help="examples per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate of the one-cycle schedule (default: 0.05; 0.2 with --small, "
                        "whose 2-epoch run takes 16 steps)")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (default: %(default)s)")
    p.add_argument("--streams", type=int, default=4, help="CUDA streams of the plan (default: %(default)s)")
    p.add_argument("--small", action="store_true", help="a small model and data set (CPU, CI)")
    p.add_argument("--no-amp", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT,
                   help="written after every epoch, its folder made (default: %(default)s; git ignores runs/)")
    p.add_argument("--resume", default=None,
                   help="a checkpoint to continue from, written with the same --epochs, --batch-size and --small")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this epoch, as if interrupted")
    args = p.parse_args(argv)
    lr = args.lr if args.lr is not None else 0.2 if args.small else 0.05
    ckpt = None
    if args.resume:  # checked first: a schedule for other options cannot go on (OneCycleLR spans the whole run)
        ckpt = torch.load(args.resume, map_location="cpu")
        made_for = {"--epochs": ckpt.get("epochs"), "--batch-size": ckpt.get("batch_size"),
                    "--small": ckpt.get("small")}
        asked = {"--epochs": args.epochs, "--batch-size": args.batch_size, "--small": args.small}
        changed = [f"{k} {made_for[k]} (now {asked[k]})" for k in made_for if made_for[k] not in (None, asked[k])]
        if changed:
            p.error(f"--resume {args.resume} was written by a run with {', '.join(changed)}; resume with the "
                    "same options, or start a new run without --resume")

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size, n_train, width = (8, 384, 4) if args.small else (32, 8192, 32)
    train_data = synthetic(n_train, size, seed=1)
    loader_rng = torch.Generator().manual_seed(0)  # the shuffle's own generator, saved in the checkpoint
    train_loader = DataLoader(train_data, batch_size=args.batch_size, shuffle=True, generator=loader_rng,
                              pin_memory=device.type == "cuda")  # the last batch is smaller: its own graph
    val_loader = DataLoader(synthetic(n_train // 4, size, seed=2), batch_size=256)
    amp = None if args.no_amp else torch.bfloat16

    model = Net(width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))
    start = 0
    if ckpt is not None:  # PyTorch's order: build model, optimizer and scheduler, then load their states
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if "rng" in ckpt:  # (older checkpoints have none: the shuffle then differs from an uninterrupted run's)
            _set_rng_state(ckpt["rng"], loader_rng)
        start = ckpt["epoch"]
        print(f"resumed from {args.resume} after epoch {start}")

    # the first batch as the example, taken without drawing a shuffle (that would move the generator)
    x0, y0 = train_data[:args.batch_size]
    step = concur.train_step(
        model, nn.functional.cross_entropy, optimizer, (x0.to(device), y0.to(device)), streams=args.streams,
        amp_dtype=amp, cuda_graph=device.type == "cuda",
        before_step=lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), args.clip))

    os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
    history = []
    for epoch in range(start, args.epochs):
        t0, losses = time.perf_counter(), []
        for x, y in train_loader:
            losses.append(step(x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
            scheduler.step()
        train_loss = torch.stack(losses).mean().item()  # one host sync per epoch, not per step
        val_loss, val_acc = evaluate(model, val_loader, device, amp)
        seconds = time.perf_counter() - t0  # after the .item()s above: the device's work is done
        if epoch == start:  # how the step runs: captured or eagerly, on how many streams, and why
            print(f"step: {step.status}")
        print(f"epoch {epoch + 1}/{args.epochs}  train loss {train_loss:.3f}  val loss {val_loss:.3f}  "
              f"val acc {val_acc:.3f}  lr {scheduler.get_last_lr()[0]:.4f}  {_seconds(seconds)}")
        history.append({"epoch": epoch + 1, "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc,
                        "seconds": seconds})
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "rng": _rng_state(loader_rng),
                    "epochs": args.epochs, "batch_size": args.batch_size, "small": args.small}, args.checkpoint)
        if args.stop_after is not None and epoch + 1 >= args.stop_after:
            break
    return {"history": history, "step": step, "checkpoint": args.checkpoint}


if __name__ == "__main__":
    main()

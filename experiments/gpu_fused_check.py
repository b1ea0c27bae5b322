"""Check concur fused (torch.compile backend) against eager on the GPU: N training steps, same data.

    PYTHONPATH=. python experiments/gpu_fused_check.py --model googlenet --batch 8 --steps 20

Dropout masks match eager only with inductor's ``fallback_random``; it is on here.
"""
import argparse
import copy
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, ".")
import concur  # noqa: E402
from experiments.bench_train import MODELS  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="googlenet")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--streams", type=int, nargs="+", default=[4])
    p.add_argument("--no-dropout", action="store_true", help="set every dropout's p to 0")
    a = p.parse_args()
    torch._inductor.config.fallback_random = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    make, size = MODELS[a.model]
    torch.manual_seed(0)
    base = make().cuda().train()
    if a.no_dropout:
        for mod in base.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
    loss_fn = nn.CrossEntropyLoss()
    data = [(torch.randn(a.batch, 3, size, size, device="cuda"), torch.randint(0, 1000, (a.batch,), device="cuda"))
            for _ in range(a.steps)]
    results = {}
    for label in ["eager", *[f"fused{k}" for k in a.streams]]:
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        torch.manual_seed(1)
        t = time.perf_counter()
        if label == "eager":
            def step(x, y):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(m(x), y)
                loss.backward()
                opt.step()
                return loss.detach()
        else:
            k = int(label[5:])
            step = concur.train_step(m, loss_fn, opt, data[0], streams=k, compile=True)
        losses = [step(x, y).item() for x, y in data]
        print(f"{label}: {time.perf_counter() - t:.1f} s, losses {losses[0]:.4f} .. {losses[-1]:.4f}", flush=True)
        if label != "eager":
            print("  graphs captured with streams:", [g.streams for g in step.graphs.values()])
            for g in step.backends[k].graphs:
                print("  ", g)
        results[label] = (losses, torch.cat([q.detach().flatten() for q in m.parameters()]))
    le, pe = results["eager"]
    for label, (lf, pf) in results.items():
        loss_err = max(abs(x - y) / abs(x) for x, y in zip(le, lf))
        param_err = ((pe - pf).norm() / pe.norm()).item()
        print(f"{label} vs eager: max rel loss diff {loss_err:.2e}, param rel diff {param_err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

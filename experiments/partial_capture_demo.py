"""Partial capture: optimize a NASNet-style network whose cell operations fx cannot trace.

    python experiments/partial_capture_demo.py

The operations inside each cell branch on tensor values and shapes
(tests/nas_models.py). A plain ``concur.optimize`` refuses the model; with
``leaf_modules="auto"`` concur keeps each such operation whole as one opaque
node, traces the cells around them, and still runs a cell's branches on
several streams. The script prints the leaves, the predicted speedup, and
checks outputs and gradients against the original model.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import concur  # noqa: E402
from tests.nas_models import NASNetStyle  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = NASNetStyle(layout="NRNRN").train()
    x = torch.randn(4, 3, 18, 18)
    try:
        concur.optimize(model, (x,))
    except concur.CaptureError as exc:
        print("without partial capture:", str(exc).splitlines()[0], "\n")

    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = concur.optimize(model, (x,), streams=4, leaf_modules="auto")
    print(f"warning: {caught[0].message}\n" if caught else "", end="")
    print(f"{len(cm.auto_leaves)} auto leaves, for example {', '.join(cm.auto_leaves[:4])}, ...")
    print(f"plan: {len(cm.schedule.order)} ops on {cm.schedule.num_streams} streams\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same warning again
        print(concur.inspect(model, (x,), leaf_modules="auto", max_streams=4), "\n")

    torch.manual_seed(1)
    y = torch.randn(4, 3, 18, 18)
    out, ref = cm(y), reference(y)
    out.square().sum().backward()
    ref.square().sum().backward()
    grad_err = max(((p.grad - q.grad).norm() / q.grad.norm()).item()
                   for p, q in zip(model.parameters(), reference.parameters())
                   if q.grad is not None)  # the branch a gated op did not take has no gradient
    print(f"output relative error {((out - ref).norm() / ref.norm()).item():.2e}, "
          f"largest gradient relative error {grad_err:.2e}")


if __name__ == "__main__":
    main()

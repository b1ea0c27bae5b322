"""Every torchvision classification model, optimized by concur, matches the original in train mode.

Each model is built with ``weights=None`` and checked by ``compare_with_original``
(outputs, gradients and BatchNorm statistics after one forward+backward) on
a batch of 2 at the smallest input size it accepts, so the whole zoo stays cheap.
By default only the smallest model of each family runs (the CI tier, about 18
models); all others are marked ``zoo_full`` and skipped unless selected. ``python -m pytest -m zoo_full tests/test_zoo.py`` runs them.

``python -m tests.test_zoo`` times every model (each in its own process) and
writes ``experiments/zoo_table.md``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Callable

import pytest
import torch
import torchvision

from tests.conftest import compare_with_original

MODELS = torchvision.models.list_models(module=torchvision.models)

# Smallest square input each model accepts where it is not 32 px.
IMAGE_SIZE = {
    "alexnet": 63,            # conv 11/4, three 3/2 max-pools
    "inception_v3": 75,       # 299 with its aux head (covered in test_api), 75 without
    "maxvit_t": 224,          # every block's input must be divisible by the 7x7 partition
}
# Constructor arguments that make a model accept the small input above.
BUILD_KWARGS = {
    "inception_v3": {"aux_logits": False, "init_weights": False},
    "googlenet": {"init_weights": False},
}
# ViTs fix their input size at construction: build them with two patches per side.
for _name in MODELS:
    _match = re.fullmatch(r"vit_[bhl]_(\d+)", _name)
    if _match:
        IMAGE_SIZE[_name] = 2 * int(_match.group(1))
        BUILD_KWARGS[_name] = {"image_size": 2 * int(_match.group(1))}

# The default (CI) tier: the smallest model of every family, so the CPU suite stays within
# its 10-minute budget on 2 cores; every other model is marked ``zoo_full``.
DEFAULT_TIER = frozenset("""
    alexnet convnext_tiny densenet121 efficientnet_b0 googlenet inception_v3 maxvit_t mnasnet0_5
    mobilenet_v3_small regnet_x_400mf resnet18 resnext50_32x4d shufflenet_v2_x0_5 squeezenet1_1
    swin_t vgg11 vit_b_16 wide_resnet50_2
""".split())
FULL_ONLY = frozenset(MODELS) - DEFAULT_TIER

# Models concur cannot optimize yet, with the reason; they are expected to fail.
UNSUPPORTED: dict[str, str] = {}

BATCH = 2


def build(name: str) -> tuple[torch.nn.Module, Callable[[], tuple]]:
    """Return a randomly initialised ``name`` in train mode and a maker of its smallest inputs."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, **BUILD_KWARGS.get(name, {}))
    size = IMAGE_SIZE.get(name, 32)
    return model.train(), lambda: (torch.randn(BATCH, 3, size, size),)


def check(name: str) -> None:
    """Raise if concur's optimized ``name`` differs from the original (outputs, grads, buffers)."""
    model, make_inputs = build(name)
    compare_with_original(model, make_inputs, streams=4, steps=1)


def _param(name: str):
    marks = []
    if name in FULL_ONLY:
        marks.append(pytest.mark.zoo_full)
    if name in UNSUPPORTED:
        marks.append(pytest.mark.xfail(reason=UNSUPPORTED[name], strict=True))
    return pytest.param(name, marks=marks)


@pytest.fixture(autouse=True)
def _skip_full_unless_selected(request):
    if request.node.get_closest_marker("zoo_full") and "zoo_full" not in (request.config.option.markexpr or ""):
        pytest.skip("large variant: run with -m zoo_full")


@pytest.mark.parametrize("name", [_param(n) for n in MODELS])
def test_torchvision_model_matches_original(name):
    check(name)


def test_zoo_list_is_classification_models_only():
    assert len(MODELS) >= 80
    assert "googlenet" in MODELS and "inception_v3" in MODELS
    assert not any(n.startswith(("fasterrcnn", "deeplab", "r3d", "raft")) for n in MODELS)
    assert FULL_ONLY <= set(MODELS) and UNSUPPORTED.keys() <= set(MODELS)
    families = {n.split("_")[0].rstrip("0123456789") for n in MODELS}
    default = {n.split("_")[0].rstrip("0123456789") for n in MODELS if n not in FULL_ONLY}
    assert families == default, f"families only in zoo_full: {families - default}"


def _time_one(name: str) -> tuple[str, float, str]:
    """Run ``check(name)`` in a fresh process; return (status, seconds, reason)."""
    code = ("import time, traceback, tests.test_zoo as z\n"
            "t = time.perf_counter()\n"
            f"try:\n    z.check({name!r}); s = 'pass'; r = ''\n"
            "except BaseException as e:\n    s = 'FAIL'; r = f'{type(e).__name__}: {e}'.splitlines()[0][:200]\n"
            "print('RESULT', s, time.perf_counter() - t, r, sep='\\t')\n")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            _, status, secs, reason = (line.split("\t") + [""])[:4]
            return status, float(secs), reason
    return "CRASH", wall, (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]


def main(argv: list[str]) -> None:
    """Time every model and write a markdown table (``experiments/zoo_table.md`` by default)."""
    names = argv or MODELS
    rows = []
    for name in names:
        status, secs, reason = _time_one(name)
        size = IMAGE_SIZE.get(name, 32)
        tier = "zoo_full" if name in FULL_ONLY else "default"
        rows.append(f"| {name} | {size} | {status} | {secs:.1f} | {tier} | {reason or UNSUPPORTED.get(name, '')} |")
        print(rows[-1], flush=True)
    if not argv:
        with open("experiments/zoo_table.md", "w") as f:
            f.write(_TABLE_HEADER + "\n".join(rows) + "\n")


_TABLE_HEADER = """# torchvision classification zoo under concur

Made by `python -m tests.test_zoo` (torch {torch}, torchvision {tv}, CPU, 2 shared cores):
`concur.optimize(model, streams=4)` in train mode, batch {batch}, `weights=None`; one
forward and backward compared with the original model by `compare_with_original`
(outputs and buffers to 1e-5, all gradients to 1e-5, each gradient to 1e-4).
Seconds include building both models and the plan. `zoo_full` rows run only with
`pytest -m zoo_full tests/test_zoo.py`.

| model | input px | status | seconds | tier | note |
|---|---|---|---|---|---|
""".format(torch=torch.__version__, tv=torchvision.__version__, batch=BATCH)

if __name__ == "__main__":
    main(sys.argv[1:])

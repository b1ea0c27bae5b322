"""Every torchvision classification model, optimized by concur, matches the original in train mode.

Each model is built with ``weights=None`` and checked by ``compare_with_original``
(outputs, gradients and BatchNorm statistics after one forward+backward) on
a batch of 2 at the smallest input size it accepts, so the whole zoo stays cheap.

Three tiers:

- default (every ``pytest`` run): a small model of 12 of the 18 families, the branchy
  ones (GoogLeNet, Inception-v3, DenseNet) included;
- ``zoo_full`` (CI's second step, ``python -m pytest -m zoo_full tests/test_zoo.py``):
  all other models, among them the 6 families whose smallest model is large
  (AlexNet, MaxViT, ResNeXt, VGG, ViT, Wide ResNet: 25-133M parameters or 224 px);
- ``zoo_giant``: vit_h_14 and regnet_y_128gf, which need more than 23 GB of RAM
  (``python -m pytest -m zoo_giant tests/test_zoo.py`` on a large machine).

``python -m tests.test_zoo`` times every model (each in its own process) and
writes ``experiments/zoo_table.md``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import subprocess
import sys
import time
from typing import Callable

import pytest
import torch
import torchvision

from concur.zoo import DEFAULT_MIN_IMAGE_SIZE, MIN_IMAGE_SIZE
from tests.conftest import compare_with_original

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = torchvision.models.list_models(module=torchvision.models)

# Smallest square input each model accepts (concur.zoo's table, which the CLI checks against).
IMAGE_SIZE = dict(MIN_IMAGE_SIZE)
# Constructor arguments that make a model accept the small input above; GoogLeNet keeps its
# auxiliary heads (they run at 32 px in train mode), unlike in the CLI.
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

# The default tier: small models, so the default CPU suite stays within 5 minutes and 4 GB on 2 cores.
DEFAULT_TIER = frozenset("""
    convnext_tiny densenet121 efficientnet_b0 googlenet inception_v3 mnasnet0_5 mobilenet_v3_small
    regnet_x_400mf resnet18 shufflenet_v2_x0_5 squeezenet1_1 swin_t
""".split())
# Families whose smallest model is too large for the default tier (parameters, or 224 px inputs).
FULL_ONLY_FAMILIES = frozenset({"alexnet", "maxvit", "resnext", "vgg", "vit", "wide"})
GIANTS = frozenset({"vit_h_14", "regnet_y_128gf"})  # > 23 GB of RAM
FULL_ONLY = frozenset(MODELS) - DEFAULT_TIER - GIANTS

# Models concur cannot optimize yet, with the reason; they are expected to fail.
UNSUPPORTED: dict[str, str] = {}

BATCH = 2


def build(name: str) -> tuple[torch.nn.Module, Callable[[], tuple]]:
    """Return a randomly initialised ``name`` in train mode and a maker of its smallest inputs."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, **BUILD_KWARGS.get(name, {}))
    size = IMAGE_SIZE.get(name, DEFAULT_MIN_IMAGE_SIZE)
    return model.train(), lambda: (torch.randn(BATCH, 3, size, size),)


def check(name: str) -> None:
    """Raise if concur's optimized ``name`` differs from the original (outputs, grads, buffers)."""
    model, make_inputs = build(name)
    compare_with_original(model, make_inputs, streams=4, steps=1)


def _param(name: str):
    marks = []
    if name in FULL_ONLY:
        marks.append(pytest.mark.zoo_full)
    if name in GIANTS:
        marks.append(pytest.mark.zoo_giant)
    if name in UNSUPPORTED:
        marks.append(pytest.mark.xfail(reason=UNSUPPORTED[name], strict=True))
    return pytest.param(name, marks=marks)


def _free_memory() -> None:
    """Give freed model memory back to the OS, so one large model's peak does not stay for the next."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(autouse=True)
def _tiers(request):
    selected = request.config.option.markexpr or ""
    for tier in ("zoo_full", "zoo_giant"):
        if request.node.get_closest_marker(tier) and tier not in selected:
            pytest.skip(f"run with -m {tier}")
    yield
    # a full collection costs ~2 s once the session's heap is large, so only the tiers of large models pay it
    if any(request.node.get_closest_marker(tier) for tier in ("zoo_full", "zoo_giant")):
        _free_memory()


@pytest.mark.parametrize("name", [_param(n) for n in MODELS])
def test_torchvision_model_matches_original(name):
    check(name)


def _family(name: str) -> str:
    return name.split("_")[0].rstrip("0123456789")


def test_the_tiers_cover_every_classification_model_once_and_every_family():
    assert len(MODELS) >= 80
    assert "googlenet" in MODELS and "inception_v3" in MODELS
    assert not any(n.startswith(("fasterrcnn", "deeplab", "r3d", "raft")) for n in MODELS)
    assert DEFAULT_TIER | FULL_ONLY | GIANTS == set(MODELS) and not DEFAULT_TIER & FULL_ONLY
    assert UNSUPPORTED.keys() <= set(MODELS) and GIANTS <= set(MODELS)
    families = {_family(n) for n in MODELS}
    default = {_family(n) for n in DEFAULT_TIER}
    assert families - default == FULL_ONLY_FAMILIES, f"families only in zoo_full: {families - default}"
    assert len(default) == 12


def test_the_cli_and_the_zoo_agree_on_the_smallest_inputs():
    from concur.zoo import load

    for name in ("inception_v3", "alexnet", "googlenet"):
        zoo = load(f"torchvision:{name}")
        assert zoo.min_image_size == IMAGE_SIZE.get(name, DEFAULT_MIN_IMAGE_SIZE)
    assert (zoo.image_size, load("torchvision:inception_v3").image_size) == (224, 299)


def _time_one(name: str) -> tuple[str, float, str]:
    """Run ``check(name)`` in a fresh process; return (status, seconds, reason)."""
    code = ("import time, traceback, tests.test_zoo as z\n"
            "t = time.perf_counter()\n"
            f"try:\n    z.check({name!r}); s = 'pass'; r = ''\n"
            "except BaseException as e:\n    s = 'FAIL'; r = f'{type(e).__name__}: {e}'.splitlines()[0][:200]\n"
            "print('RESULT', s, time.perf_counter() - t, r, sep='\\t')\n")
    env = dict(os.environ, PYTHONPATH=ROOT)  # where tests.test_zoo is, whatever the cwd
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
        size = IMAGE_SIZE.get(name, DEFAULT_MIN_IMAGE_SIZE)
        tier = "zoo_giant" if name in GIANTS else "zoo_full" if name in FULL_ONLY else "default"
        rows.append(f"| {name} | {size} | {status} | {secs:.1f} | {tier} | {reason or UNSUPPORTED.get(name, '')} |")
        print(rows[-1], flush=True)
    if not argv:
        with open(os.path.join(ROOT, "experiments", "zoo_table.md"), "w") as f:
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

"""examples/train.py runs end to end on CPU in its small configuration, and resumes from its checkpoint."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    spec = importlib.util.spec_from_file_location("concur_example_train", os.path.join(ROOT, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_checkpoints_and_resumes(tmp_path):
    example = _example()
    ckpt = str(tmp_path / "ckpt.pt")
    first = example.main(["--small", "--epochs", "3", "--stop-after", "2", "--checkpoint", ckpt])
    assert [h["epoch"] for h in first["history"]] == [1, 2]
    resumed = example.main(["--small", "--epochs", "3", "--checkpoint", ckpt, "--resume", ckpt])
    assert [h["epoch"] for h in resumed["history"]] == [3]
    losses = [h["train_loss"] for h in first["history"] + resumed["history"]]
    assert all(loss == pytest.approx(loss) for loss in losses)  # finite, not NaN
    assert losses[-1] < losses[0], f"training loss should fall: {losses}"

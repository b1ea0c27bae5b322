"""examples/train.py on CPU in its small configuration: it learns, times its epochs, checkpoints out of git's way,
and resumes as if never interrupted (same shuffle), refusing a resume with other options."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHANCE = 1 / 12  # twelve classes


def _example():
    spec = importlib.util.spec_from_file_location("concur_example_train", os.path.join(ROOT, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


def test_the_documented_run_learns_and_times_its_epochs(example, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default checkpoint goes under the current folder
    run = example.main(["--small", "--epochs", "2"])  # as the README and the docstring say
    accuracy = [h["val_acc"] for h in run["history"]]
    assert accuracy[-1] > 6 * CHANCE, f"the documented run does not learn: val acc {accuracy}"
    out = capsys.readouterr().out.splitlines()
    printed = [line for line in out if line.startswith("epoch ")]
    assert len(printed) == 2
    status = [line for line in out if line.startswith("step: ")]
    assert status == [f"step: {run['step'].status}"] and "eager" in status[0]  # a CPU run says it is not captured
    for line, h in zip(printed, run["history"]):
        value, unit = re.search(r"  (\d+(?:\.\d)?) (ms|s)$", line).groups()
        shown = float(value) / (1000 if unit == "ms" else 1)
        assert h["seconds"] > 0 and shown > 0, line  # not "0.0 s"
        assert shown == pytest.approx(h["seconds"], abs=0.051), line
    assert run["checkpoint"] == os.path.join("runs", "train", "ckpt.pt")
    assert (tmp_path / "runs" / "train" / "ckpt.pt").is_file()


def test_help_shows_the_default_checkpoint_which_git_ignores(example, capsys):
    with pytest.raises(SystemExit) as done:
        example.main(["--help"])
    assert done.value.code == 0
    assert f"(default: {example.DEFAULT_CHECKPOINT}; git ignores runs/)" in " ".join(capsys.readouterr().out.split())
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: nothing to ignore the checkpoint")
    for where in ("", "examples"):  # run from the repository's root or from examples/
        path = os.path.join(where, example.DEFAULT_CHECKPOINT)
        ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT)
        assert ignored.returncode == 0, f"git would see {path}"


def test_a_resumed_run_goes_on_as_the_uninterrupted_one(example, tmp_path):
    whole = example.main(["--small", "--epochs", "3", "--checkpoint", str(tmp_path / "whole.pt")])
    ckpt = str(tmp_path / "ckpt.pt")
    first = example.main(["--small", "--epochs", "3", "--stop-after", "2", "--checkpoint", ckpt])
    assert [h["epoch"] for h in first["history"]] == [1, 2]
    resumed = example.main(["--small", "--epochs", "3", "--checkpoint", ckpt, "--resume", ckpt])
    assert [h["epoch"] for h in resumed["history"]] == [3]
    losses = [h["train_loss"] for h in first["history"] + resumed["history"]]
    assert losses[-1] < losses[0], f"training loss should fall: {losses}"
    # the same shuffle (the RNG states are in the checkpoint), so the same batches and the same third epoch
    for key in ("train_loss", "val_loss", "val_acc"):
        assert resumed["history"][0][key] == pytest.approx(whole["history"][2][key], rel=1e-6, abs=1e-9), key


def test_a_resume_with_other_epochs_is_refused_in_one_line(example, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt.pt")
    example.main(["--small", "--epochs", "2", "--stop-after", "1", "--checkpoint", ckpt])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        example.main(["--small", "--epochs", "4", "--checkpoint", ckpt, "--resume", ckpt])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"--resume {ckpt} was written by a run with --epochs 2 (now 4); resume with the same options" in err
    assert "Traceback" not in err

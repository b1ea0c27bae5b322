"""The concur command: inspect prints the plan; demo checks the model and exits 0."""

from __future__ import annotations

import pytest

from concur.cli import main


def test_inspect_prints_width_critical_path_and_plan(capsys):
    assert main(["inspect", "torchvision:googlenet", "--batch-size", "2", "--image-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "critical path" in out and "predicted speedup" in out
    assert "cross-stream waits" in out and "on 4 streams" in out


def test_demo_checks_against_original_and_succeeds(capsys):
    assert main(["demo", "--batch-size", "2", "--image-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "-> OK" in out and "predicted speedup" in out


def test_bad_model_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="torchvision:googlenet"):
        main(["inspect", "googlenet"])

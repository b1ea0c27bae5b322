"""concur/dag/calibration.py (the calibrated prediction) and experiments/calibrate.py (the fit that makes it).

Synthetic measured decisions are made with a known calibration, so the fit
must give it back; the end-to-end test writes them through the cache concur
itself writes (:class:`concur.dag.disk_cache.JsonCache`).
"""

from __future__ import annotations

import doctest
import json
import shutil

import pytest

import concur.dag.calibration as calibration
from concur.dag.calibration import Calibration, calibrated_speedup, calibration_for
from concur.dag.decide import Prediction
from concur.dag.disk_cache import JsonCache
from experiments import calibrate
from experiments.calibration import constants, fit, rows as calibration_rows, table as calibration_table

H100 = "NVIDIA H100 80GB HBM3"


def _measured(predicted: float, ideal: float, shared: float, ideal_gap: float = 0.0) -> float:
    """The speedup a GPU with this calibration would measure for a prediction."""
    return Calibration(gpu="", roofline="", shared=shared, ideal_gap=ideal_gap).speedup(predicted, ideal)


def _row(model: str, predicted: float, ideal: float, measured: float) -> calibration_rows.Row:
    return calibration_rows.Row(model, f"a graph predicted {predicted}", predicted, ideal, measured, 1.0,
                                1.0 / measured)


PREDICTIONS = [(1.1, 1.5), (1.3, 2.0), (1.6, 2.4), (2.0, 3.5), (1.05, 1.2), (1.45, 3.0)]  # (speedup, ideal)


def test_doctests():
    assert doctest.testmod(calibration).failed == 0
    for module in (calibrate, calibration_rows, fit, calibration_table, constants):
        assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("shared, ideal_gap", [(0.6, 0.0), (0.8, -0.3)])
def test_the_fit_recovers_known_constants(shared, ideal_gap):
    rows = [_row(f"net{i % 3}", p, i_, _measured(p, i_, shared, ideal_gap)) for i, (p, i_) in enumerate(PREDICTIONS)]
    weights = fit.fit(rows, fit.FITS["contention"])
    assert weights["shared"] == pytest.approx(shared, abs=1e-9)
    assert weights["ideal_gap"] == pytest.approx(ideal_gap, abs=1e-9)
    if ideal_gap == 0:
        assert fit.fit(rows, fit.FITS["shrink"]) == pytest.approx({"shared": shared, "ideal_gap": 0.0})


def test_too_few_rows_for_the_constants_is_an_error():
    with pytest.raises(ValueError, match="cannot fit 2 constants"):
        fit.fit([_row("a", 1.5, 2.0, 1.2)], fit.FITS["contention"])


def test_the_calibration_applies_only_to_its_gpu():
    fitted = Calibration(gpu=H100, roofline="h100", shared=0.5, rows=12, networks=3)
    table = {H100: fitted, "NVIDIA A100-SXM4-80GB": Calibration(gpu="NVIDIA A100-SXM4-80GB", roofline="a100",
                                                                 placeholder=True)}
    p = Prediction(num_streams=2, serial_us=22.0, ideal_us=11.0, streams_us=14.0)  # 1.57x, ideal 2x
    half = 1 / (1 - 0.5 * (1 - 14.0 / 22.0))
    assert calibrated_speedup(p, H100, table) == (pytest.approx(half), H100)
    assert calibrated_speedup(p, " nvidia  h100 80gb hbm3", table) == (pytest.approx(half), H100)
    assert calibrated_speedup(p, "h100", table) == (pytest.approx(half), H100)  # the roofline, without a GPU
    for other in ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "h200", "", None):  # A100: a placeholder only
        assert calibrated_speedup(p, other, table) == (p.speedup, None)


def test_a_placeholder_is_the_identity_and_never_applies():
    placeholder = Calibration(gpu=H100, roofline="h100", placeholder=True)
    assert placeholder.speedup(1.57, 2.0) == pytest.approx(1.57)
    assert calibration_for(H100, {H100: placeholder}) is None


def test_the_calibrated_speedup_never_passes_the_ideal_bound():
    generous = Calibration(gpu=H100, roofline="h100", shared=1.5)
    assert generous.speedup(1.8, 2.0) == pytest.approx(2.0)
    assert generous.speedup(1.8) == pytest.approx(1.8)  # ideal unknown: taken as the prediction
    assert generous.speedup(1.2, 2.0) == pytest.approx(1 / (1 - 1.5 * (1 - 1 / 1.2)))
    assert generous.speedup(float("nan"), 2.0) != generous.speedup(float("nan"), 2.0)  # returned as it is


def test_mean_abs_error_is_relative_to_the_measurement():
    assert fit.mean_abs_error([1.2, 0.9], [1.0, 1.2]) == pytest.approx((0.2 + 0.25) / 2)
    with pytest.raises(ValueError):
        fit.mean_abs_error([1.0], [1.0, 1.1])


def test_the_report_grades_each_network_by_a_fit_without_it():
    # net "a" delivers 40% of the predicted saving, net "b" 80%: a fit on "b" alone calibrates "a"
    rows = [_row("a-b8", p, i, _measured(p, i, 0.4)) for p, i in PREDICTIONS[:3]]
    rows += [_row("b-b32", p, i, _measured(p, i, 0.8)) for p, i in PREDICTIONS[3:]]
    rep = fit.report(rows, "shrink")
    measured = [r.measured for r in rep.rows]
    assert rep.mae_raw == pytest.approx(fit.mean_abs_error([r.predicted for r in rep.rows], measured))
    assert [r.network for r in rep.rows] == ["a"] * 3 + ["b"] * 3
    assert rep.held_out == pytest.approx([_measured(r.predicted, r.ideal, 0.8 if r.network == "a" else 0.4)
                                          for r in rep.rows])
    assert rep.mae_held_out == pytest.approx(fit.mean_abs_error(rep.held_out, measured))
    assert rep.mae_held_out > rep.mae_in_sample > 0
    assert fit.report(rows[:3]).held_out is None  # one network: nothing to hold out


def _entry(p: float, ideal: float, measured: float, what: str) -> dict:
    serial_us = 1000.0
    return {"keep": measured > 1.01, "one_stream_ms": 2.0, "streams_ms": 2.0 / measured, "rounds": 7,
            "predicted_speedup": p, "ideal_speedup": ideal, "serial_us": serial_us, "streams_us": serial_us / p,
            "num_streams": 4, "what": what}


def test_calibrate_runs_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    for i, (p, ideal) in enumerate(PREDICTIONS):
        model = ("googlenet-b32", "resnet50-b8", "inception_v3-b8")[i % 3]
        JsonCache(run / model).put(f"key{i}", _entry(p, ideal, _measured(p, ideal, 0.6), f"the graph {i}"))
    JsonCache(tmp_path / "flat" / "decisions").put("k", _entry(1.3, 2.0, _measured(1.3, 2.0, 0.6), "flat"))
    JsonCache(run / "googlenet-b32", kind="tuner").put("t", {"streams": 4, "scheduler": "critical_path"})
    # a whole step's decision (concur.training.step_streams) is not one graph's: passed over
    JsonCache(run / "googlenet-b32").put("step", dict(_entry(1.3, 2.0, 1.1, "the forward and backward"), scope="step"))
    (run / "resnet50-b8" / "decisions" / "broken.json").write_text("{not json")
    target = tmp_path / "calibration.py"
    shutil.copy(calibration.__file__, target)
    rows = tmp_path / "rows.jsonl"

    args = [str(run), str(tmp_path / "flat"), "--gpu", H100, "--torch", "2.11.0+cu130", "--rows", str(rows)]
    assert calibrate.main([*args, "--write", str(target)]) == 0
    out = capsys.readouterr().out
    assert "googlenet-b32" in out and "the graph 0" in out and "3 other JSON files passed over" in out
    assert "7 measured rows of 4 models, 4 networks" in out
    assert "fit shrink: measured saving = 0.600 x shared" in out and "calibrated 0.0% with each network" in out

    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert sorted(r["model"] for r in written) == sorted(["googlenet-b32", "resnet50-b8", "inception_v3-b8"] * 2
                                                         + ["flat"])
    assert all(r["calibrated"] == pytest.approx(r["measured"]) for r in written)

    compile(target.read_text(), str(target), "exec")
    cal = constants.read_constants(target)[H100]
    assert (cal.shared, cal.ideal_gap, cal.rows, cal.networks, cal.torch, cal.placeholder) == (
        0.6, 0.0, 7, 4, "2.11.0+cu130", False)
    assert cal.mae_raw > 0.1 and cal.mae_calibrated == 0.0 and cal.roofline == "h100"

    # another GPU's entry joins the H100's rather than replacing it
    assert calibrate.main([*args[:2], "--gpu", "NVIDIA H200", "--rows", str(rows), "--write", str(target)]) == 0
    assert set(constants.read_constants(target)) == {H100, "NVIDIA H200"}


def test_the_shipped_constants_are_what_calibrate_writes():
    text = open(calibration.__file__).read()
    block = text[text.index(constants.BEGIN):]
    block = block[:block.index("\n", block.index(constants.END)) + 1]
    assert constants.render(constants.read_constants(constants.TARGET)) == block
    assert constants.read_constants(constants.TARGET) == calibration.CALIBRATIONS

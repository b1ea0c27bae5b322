"""On a GPU: the measured tuner on GoogLeNet b8, and a real report from the experiment script."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torchvision

import concur
from concur.observe.tuner import tune_train_step
from tests.conftest import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def googlenet_b8():
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).cuda().train()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (8,), device="cuda")
    return model, x, y


def test_tuner_on_googlenet_b8_is_never_slower_than_serial_leaves_the_model_alone_and_caches(tmp_path):
    model, x, y = googlenet_b8()
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()  # momentum buffers exist: tuning must not touch them
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    rng = torch.cuda.get_rng_state()

    result = tune_train_step(model, loss_fn, opt, (x, y), make_step=concur.train_step, cache_dir=tmp_path, budget_s=20, progress=True)
    print(f"\nchose {result.config.label}: {result.measurement} vs serial {result.baseline}; {result.stopped}; "
          f"lever {result.lever} (eager utilization {result.eager_utilization}); {result.seconds:.1f} s")
    assert result.baseline is not None and result.measurement is not None
    assert result.measurement.median_ms <= result.baseline.median_ms
    assert result.seconds <= 25, "the budget is 20 s; one trial may overrun it a little"
    if result.eager_utilization is not None:  # NVML present: eager GoogLeNet b8 is launch-bound
        assert result.eager_utilization < 60 and result.lever == "capture"
    assert not [t for t in result.trials if t.error and t.config.streams <= 4], result.trials

    after = (model.state_dict(), opt.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    for p, s in before[1]["state"].items():
        assert torch.equal(s["momentum_buffer"], after[1]["state"][p]["momentum_buffer"])
    assert torch.equal(rng, torch.cuda.get_rng_state())

    again = tune_train_step(model, loss_fn, opt, (x, y), make_step=concur.train_step, cache_dir=tmp_path, budget_s=20, progress=False)
    assert again.from_cache and again.config == result.config


def test_experiment_script_writes_a_real_report(tmp_path):
    from experiments import gpu_tuner_report as script

    rc = script.main(["--out", str(tmp_path), "--cases", "googlenet:8", "--sweep", "1", "4",
                      "--repeats", "10", "--phase-s", "1"])
    assert rc == 0
    row = json.loads((tmp_path / "gpu_tuner_results.json").read_text())["results"][0]
    assert "error" not in row and row["cache_hit"] is True and row["chosen_ms"] is not None
    report_dir = tmp_path / "run" / "report"
    data = json.loads((report_dir / "report.json").read_text())
    case = data["cases"][0]
    assert {v["role"] for v in case["variants"]} == {"eager", "serial", "sweep", "tuned"}
    serial = next(o for o in case["overlap"] if o["label"] == "serial graph")
    assert serial["kernels"] and serial["kernels"] > 50 and serial["wall_ms"] > 0
    if case["monitor"]["available"]:
        labels = [p["label"] for p in case["phases"]]
        assert labels[:2] == ["eager", "serial graph"]
        assert case["phases"][0]["utilization"] < case["phases"][1]["utilization"]
    for png in ("googlenet_b8_steptime.png", "googlenet_b8_gantt.png", "summary_speedup.png"):
        assert (report_dir / png).stat().st_size > 5000, png
    assert (report_dir / "index.html").stat().st_size > 10000

"""experiments/capture_stress.py on CPU: the plugin counts what each capture went through, the parent sums it."""

from __future__ import annotations

import json
import types

from experiments import capture_stress


def test_the_plugin_counts_each_captures_outcome_from_the_steps_log(monkeypatch, tmp_path):
    import concur.training.step as step_module

    log = types.SimpleNamespace(captures=0, failures=0, recovered=0)

    def capture(step, *args):
        log.captures += 1
        log.failures += 2
        log.recovered += 1
        return None if args[0] == "eager" else "graph"

    monkeypatch.setattr(step_module, "capture_with_fallback", capture)
    monkeypatch.setattr(capture_stress, "_counts", capture_stress.collections.Counter())
    capture_stress.pytest_configure(config=None)
    step = types.SimpleNamespace(capture_log=log)
    assert step_module.capture_with_fallback(step, "captured") == "graph"
    assert step_module.capture_with_fallback(step, "eager") is None
    counts = tmp_path / "counts.json"
    monkeypatch.setenv("CAPTURE_STRESS_COUNTS", str(counts))
    capture_stress.pytest_sessionfinish(session=None, exitstatus=0)
    assert json.loads(counts.read_text()) == {"captures": 2, "failures": 4, "recovered": 2, "eager_shapes": 1,
                                              "exitstatus": 0}


def test_totals_sum_every_process_and_count_those_whose_tests_failed():
    rows = [{"returncode": 0, "captures": 5, "failures": 1, "recovered": 1, "eager_shapes": 0},
            {"returncode": 1, "captures": 2, "failures": 0, "recovered": 0, "eager_shapes": 1},
            {"returncode": 5}]  # every test skipped, no counts
    assert capture_stress.totals(rows) == {"captures": 7, "failures": 1, "recovered": 1, "eager_shapes": 1,
                                           "processes": 3, "processes_failed": 1}

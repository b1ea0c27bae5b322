"""experiments/memory.py, the memory-pressure benchmark: its orchestration on the CPU, children faked.

A child needs CUDA, so the parent's side is tested with the child faked at the
subprocess boundary (``memory._launch``), and the child's own function runs in
this process (or a fresh one) with its few CUDA calls stood in for and a tiny
model in place of the networks.
"""

from __future__ import annotations

import argparse
import math
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from experiments import memory, peers, sweep_models

MB = 2**20


def _args(tmp_path: Path, **overrides) -> argparse.Namespace:
    argv = ["--out", str(tmp_path), "--networks", "googlenet", "--batches", "8", "--paths", "fused"]
    args = memory.parse_args(argv)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def _fake_row(payload: dict, **fields) -> dict:
    row = dict(memory.base_row(payload), outcome="fit", oom=False, gpu="Fake GPU", peak_allocated_mb=100.0,
               peak_reserved_mb=200.0, ms_per_step=2.0, streams=None if payload["who"] == "recipe" else 4)
    return dict(row, **fields)


class FakeLauncher:
    """Stands in for the child processes: records each payload and env, answers with ``answer(payload)``."""

    def __init__(self, answer):
        self.answer, self.payloads, self.envs = answer, [], []

    def __call__(self, payload: dict, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
        self.payloads.append(payload)
        self.envs.append(env)
        result = self.answer(payload)
        if isinstance(result, subprocess.CompletedProcess):
            return result
        return subprocess.CompletedProcess([], 0, memory.ROW_MARK + json.dumps(result) + "\n", "")


def test_each_limited_run_gets_the_recipes_peak_reserved_times_the_limit(tmp_path, monkeypatch):
    launcher = FakeLauncher(lambda p: _fake_row(p, peak_reserved_mb=1000.0))
    monkeypatch.setattr(memory, "_launch", launcher)
    memory.run(_args(tmp_path, limit=1.05, streams=["auto"]))
    alone, *limited = launcher.payloads
    assert (alone["side"], alone["limit_bytes"], alone["limit"]) == ("recipe_alone", None, None)
    assert [p["side"] for p in limited] == ["recipe", "concur", "concur_streams1", "concur_streamsauto"]
    assert [p["streams"] for p in limited] == [None, None, 1, "auto"]
    for p in limited:
        assert p["limit_bytes"] == pytest.approx(1.05 * 1000 * MB) and p["limit"] == 1.05


def test_a_second_trial_adds_a_run_of_the_defaults_timed_that_way(tmp_path, monkeypatch):
    launcher = FakeLauncher(lambda p: _fake_row(p, peak_reserved_mb=1000.0))
    monkeypatch.setattr(memory, "_launch", launcher)
    memory.run(_args(tmp_path, without_streams1=True, trial=["one-at-a-time", "side-by-side"]))
    sides = [(p["side"], p["trial"]) for p in launcher.payloads[1:]]
    assert sides == [("recipe", "one-at-a-time"), ("concur", "one-at-a-time"), ("concur_side_by_side", "side-by-side")]
    launcher.payloads.clear()
    memory.run(_args(tmp_path, without_streams1=True, trial=["side-by-side"]))
    assert [(p["side"], p["trial"]) for p in launcher.payloads[2:]] == [("concur", "side-by-side")]


def test_lean_pools_adds_a_run_of_the_defaults_whose_first_plans_save_no_pooling_indices(tmp_path, monkeypatch):
    launcher = FakeLauncher(lambda p: _fake_row(p, peak_reserved_mb=1000.0))
    monkeypatch.setattr(memory, "_launch", launcher)
    memory.run(_args(tmp_path, without_streams1=True, lean_pools=True))
    assert [(p["side"], p["lean_pools"]) for p in launcher.payloads[1:]] == [
        ("recipe", False), ("concur", False), ("concur_lean_pools", True)]
    assert memory.parse_args(["--out", str(tmp_path), "--lean-pools"]).lean_pools


def test_training_memory_adds_a_run_of_the_defaults_planned_for_trainings_memory(tmp_path, monkeypatch):
    launcher = FakeLauncher(lambda p: _fake_row(p, peak_reserved_mb=1000.0))
    monkeypatch.setattr(memory, "_launch", launcher)
    memory.run(_args(tmp_path, without_streams1=True, training_memory=True))
    assert [(p["side"], p["memory_model"]) for p in launcher.payloads[1:]] == [
        ("recipe", "forward"), ("concur", "forward"), ("concur_training_memory", "training")]
    assert memory.parse_args(["--out", str(tmp_path), "--training-memory"]).training_memory


def test_without_streams1_runs_the_recipe_and_the_defaults_only(tmp_path, monkeypatch):
    launcher = FakeLauncher(lambda p: _fake_row(p, peak_reserved_mb=1000.0))
    monkeypatch.setattr(memory, "_launch", launcher)
    memory.run(memory.parse_args(["--out", str(tmp_path), "--networks", "googlenet", "--batches", "64", "--paths",
                                  "fused", "--without-streams1"]))
    assert [p["side"] for p in launcher.payloads] == ["recipe_alone", "recipe", "concur"]


def test_the_fraction_is_the_limit_over_the_devices_total_and_set_before_setup(monkeypatch):
    order = []
    monkeypatch.setattr(memory, "_device", lambda: ("Fake GPU", 4000 * MB))
    monkeypatch.setattr(memory, "_set_limit", lambda f: order.append(("limit", f)))

    def setup(*a):
        order.append(("setup",))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(memory, "setup", setup)
    monkeypatch.setattr(memory, "_peaks", lambda: (0, 0))
    payload = _payload("recipe", "recipe", None, limit_bytes=1050 * MB)
    row = memory.child(payload)
    assert order == [("limit", pytest.approx(1050 / 4000)), ("setup",)]
    assert row["fraction"] == pytest.approx(0.2625) and row["limit_mb"] == pytest.approx(1050)
    assert memory.memory_fraction(5000 * MB, 4000 * MB) == 1.0  # torch refuses a fraction over 1


def test_each_concur_child_gets_a_fresh_decision_cache_of_its_own(tmp_path, monkeypatch):
    seen = {}

    def answer(payload):
        cache = launcher.envs[-1].get("CONCUR_CACHE_DIR")
        seen[payload["side"]] = cache
        if payload["who"] == "concur":
            assert os.path.isdir(cache) and not os.listdir(cache)
        return _fake_row(payload)
    launcher = FakeLauncher(answer)
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path / "shared"))
    monkeypatch.setattr(memory, "_launch", launcher)
    memory.run(_args(tmp_path))
    concur = [seen["concur"], seen["concur_streams1"]]
    assert seen["recipe_alone"] == seen["recipe"] == str(tmp_path / "shared")  # untouched: the recipe never reads it
    assert len(set(concur)) == 2 and str(tmp_path / "shared") not in concur
    assert not any(os.path.exists(c) for c in concur)  # removed once the child is done


def test_a_crashing_or_hanging_child_becomes_an_error_row_and_the_run_goes_on(tmp_path, monkeypatch):
    def answer(payload):
        if payload["side"] == "concur":
            return subprocess.CompletedProcess([], -11, "half a line\n", "Fatal Python error: Segmentation fault")
        if payload["side"] == "concur_streams1":
            raise subprocess.TimeoutExpired("python", 5)
        return _fake_row(payload)
    monkeypatch.setattr(memory, "_launch", FakeLauncher(answer))
    rows = {r["side"]: r for r in memory.run(_args(tmp_path))}
    crashed, hung = rows["concur"], rows["concur_streams1"]
    assert (crashed["outcome"], crashed["error_type"], crashed["error"]) == ("error", "ChildCrashed",
                                                                             "killed by SIGSEGV")
    assert "Segmentation fault" in crashed["stderr_tail"] and crashed["network"] == "googlenet"
    assert (hung["outcome"], hung["error_type"]) == ("error", "Timeout")
    assert rows["recipe"]["outcome"] == "fit"


def test_a_row_printed_before_a_crash_on_exit_stands(tmp_path, monkeypatch):
    def answer(payload):
        row = _fake_row(payload)
        return subprocess.CompletedProcess([], -6, memory.ROW_MARK + json.dumps(row) + "\n", "abort at exit")
    monkeypatch.setattr(memory, "_launch", FakeLauncher(answer))
    row = memory.run_child(_payload("concur", "concur", None, limit_bytes=MB))
    assert row["outcome"] == "fit" and row["exit_code"] == -6


def test_no_limited_run_where_the_recipe_alone_failed(tmp_path, monkeypatch):
    launcher = FakeLauncher(lambda p: dict(memory.base_row(p), outcome="error", error_type="ModuleNotFoundError",
                                           error="timm not installed", oom=False))
    monkeypatch.setattr(memory, "_launch", launcher)
    rows = memory.run(_args(tmp_path, networks=["hrnet_w18_small"]))
    assert [p["side"] for p in launcher.payloads] == ["recipe_alone"]
    assert [r["outcome"] for r in rows] == ["error", "skipped", "skipped", "skipped"]
    assert "ModuleNotFoundError" in rows[1]["error"]


def test_jobs_run_configurations_side_by_side_and_rows_keep_the_configurations_order(tmp_path, monkeypatch):
    import threading
    import time

    running, most = set(), [0]
    lock = threading.Lock()

    def answer(payload):
        with lock:
            running.add(payload["batch"])
            most[0] = max(most[0], len(running))
        time.sleep(0.05)
        with lock:
            running.discard(payload["batch"])
        return _fake_row(payload)
    monkeypatch.setattr(memory, "_launch", FakeLauncher(answer))
    rows = memory.run(_args(tmp_path, batches=[8, 64, 128], jobs=3))
    assert most[0] > 1
    assert [r["batch"] for r in rows] == [8] * 4 + [64] * 4 + [128] * 4


# --- the child's function, its CUDA calls stood in for -------------------------------------------------------

class Tiny(nn.Module):
    def __init__(self, warn: str | None = None):
        super().__init__()
        self.body, self.warn = nn.Sequential(nn.Flatten(), nn.Linear(12, 10)), warn

    def forward(self, x):
        if self.warn:
            warnings.warn(self.warn)
        return self.body(x)


def _tiny_setup(warn: str | None = None):
    def setup(name, batch_size):
        torch.manual_seed(0)
        batch = (torch.randn(batch_size, 3, 2, 2), torch.randint(0, 10, (batch_size,)))
        return Tiny(warn), batch, nn.CrossEntropyLoss(), lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)
    return setup


def _payload(side: str, who: str, streams, limit_bytes=None, path="unfused", network="googlenet",
             trial="one-at-a-time", lean_pools=False, memory_model="forward") -> dict:
    return dict(network=network, batch=2, path=path, side=side, who=who, streams=streams,
                limit=1.05 if limit_bytes else None, limit_bytes=limit_bytes, steps=2, timed_steps=3, trial=trial,
                lean_pools=lean_pools, memory_model=memory_model)


@pytest.fixture
def cpu_child(monkeypatch):
    """The child's CUDA calls stood in for, the graph recipes by the plain loop, the networks by a tiny model."""
    calls = {"peaks": 0, "reset": 0}

    def peaks():
        calls["peaks"] += 1
        return (100 + calls["reset"]) * MB, (200 + calls["reset"]) * MB  # the steady window reads higher
    monkeypatch.setattr(memory, "_device", lambda: ("Fake GPU", 8000 * MB))
    monkeypatch.setattr(memory, "_set_limit", lambda f: None)
    monkeypatch.setattr(memory, "_peaks", peaks)
    monkeypatch.setattr(memory, "_held", lambda: (50 * MB, 150 * MB))
    monkeypatch.setattr(memory, "_reset_peaks", lambda: calls.__setitem__("reset", calls["reset"] + 1))
    monkeypatch.setattr(memory, "_ms_per_step", lambda fn, steps: [fn() for _ in range(steps)] and 1.5)
    for recipe in memory.RECIPE_OF_PATH.values():
        monkeypatch.setitem(peers.RECIPES, recipe, peers.eager_step)
    monkeypatch.setattr(memory, "setup", _tiny_setup())
    # a child sets the step's policies for its process; here that process runs the other tests after this one
    from concur.training import rungs, trial as trial_policy
    monkeypatch.setattr(trial_policy, "SIDE_BY_SIDE", trial_policy.SIDE_BY_SIDE)
    monkeypatch.setattr(rungs, "LEAN_POOLS_FIRST", rungs.LEAN_POOLS_FIRST)
    monkeypatch.setattr(rungs, "MEMORY_MODEL_FIRST", rungs.MEMORY_MODEL_FIRST)
    monkeypatch.setattr(rungs, "CALLER_MEMORY_AFTER_OUT_OF_MEMORY", rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY)
    from concur.fx import plan
    monkeypatch.setattr(plan, "SERIAL_WEIGHT_GRADS", plan.SERIAL_WEIGHT_GRADS)
    return monkeypatch


def test_a_recipe_row_has_the_peaks_times_and_meta(cpu_child):
    row = memory.child(_payload("recipe", "recipe", None, limit_bytes=1000 * MB))
    assert row["outcome"] == "fit" and row["recipe"] == "eager_graph" and row["ms_per_step"] == 1.5
    assert (row["setup_peak_allocated_mb"], row["setup_peak_reserved_mb"]) == (100, 200)
    assert (row["steady_peak_allocated_mb"], row["steady_peak_reserved_mb"]) == (101, 201)
    assert (row["peak_allocated_mb"], row["peak_reserved_mb"]) == (101, 201)
    assert (row["held_allocated_mb"], row["held_reserved_mb"]) == (50, 150)
    assert row["gpu"] == "Fake GPU" and row["torch"] == torch.__version__ and len(row["date"]) == 10


def test_concurs_warning_that_it_ran_eagerly_is_a_fallback_and_others_warnings_are_not(cpu_child):
    # on the CPU concur's captured step runs its plan eagerly, and says so: the fallback case, for real
    row = memory.child(_payload("concur_streams1", "concur", 1))
    assert row["outcome"] == "fallback", row
    assert any("runs eagerly" in t for t in row["fallback_warnings"])
    assert row["mode"] == "eager" and row["graph_streams"] == []  # nothing captured
    cpu_child.setattr(memory, "setup", _tiny_setup(warn="a model's own warning: falling back to float32"))
    row = memory.child(_payload("recipe", "recipe", None))
    assert row["outcome"] == "fit" and row["fallback_warnings"] == []
    assert row["warnings"] == ["a model's own warning: falling back to float32"]  # once, though every step warned


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB\nmore"),
                                   RuntimeError("backend compiler failed")])
def test_an_exception_in_the_child_is_its_outcome_and_an_oom_is_counted_as_one(cpu_child, error):
    def failing(*a):
        if isinstance(error, torch.OutOfMemoryError):
            raise error
        raise error from torch.OutOfMemoryError("CUDA out of memory")  # inductor wraps what it hits
    cpu_child.setattr(memory, "setup", failing)
    row = memory.child(_payload("concur", "concur", None))
    assert row["outcome"] == "error" and row["oom"] is True
    assert row["error_type"] == type(error).__name__
    assert row["error"] == str(error).splitlines()[0] and row["peak_reserved_mb"] == 200


@pytest.mark.parametrize("trial", memory.TRIALS)
def test_a_concur_row_says_how_its_step_timed_its_programs_and_the_step_timed_them_so(cpu_child, trial):
    from concur.training import trial as trial_policy

    row = memory.child(_payload("concur", "concur", None, trial=trial))
    assert row["trial"] == trial and trial_policy.SIDE_BY_SIDE == (trial == "side-by-side")
    assert memory.child(_payload("recipe", "recipe", None, trial=trial))["trial"] is None


@pytest.mark.parametrize("lean", [False, True])
def test_a_concur_row_says_whether_its_first_plans_save_pooling_indices_and_the_step_planned_so(cpu_child, lean):
    from concur.training import rungs

    row = memory.child(_payload("concur", "concur", None, lean_pools=lean))
    assert row["lean_pools"] is lean and rungs.LEAN_POOLS_FIRST is lean
    assert memory.child(_payload("recipe", "recipe", None, lean_pools=lean))["lean_pools"] is None


@pytest.mark.parametrize("model", ["forward", "training"])
def test_a_concur_row_says_what_memory_its_plans_count_and_the_step_planned_so(cpu_child, monkeypatch, model):
    from concur.fx import module as api
    from concur.training import rungs

    asked = []
    optimize = api.optimize
    monkeypatch.setattr(api, "optimize", lambda *a, **kw: asked.append(kw["memory_model"]) or optimize(*a, **kw))
    row = memory.child(_payload("concur", "concur", None, memory_model=model))
    assert row["memory_model"] == model and rungs.MEMORY_MODEL_FIRST == model and set(asked) == {model}
    assert memory.child(_payload("recipe", "recipe", None, memory_model=model))["memory_model"] is None


@pytest.mark.parametrize("unsplit", [False, True])
def test_unsplit_weight_grads_builds_every_concur_step_without_the_split_and_the_row_says_so(cpu_child, unsplit):
    import concur

    asked = []
    train_step = concur.train_step
    cpu_child.setattr(concur, "train_step", lambda *a, **kw: asked.append(kw) or train_step(*a, **kw))
    row = memory.child(dict(_payload("concur", "concur", None), unsplit_weight_grads=unsplit))
    assert row["outcome"] != "error" and row["unsplit_weight_grads"] is unsplit
    assert [kw.get("split_weight_grads") for kw in asked] == [False if unsplit else None]
    assert memory._payload(memory.Config("googlenet", 64, "unfused"), memory.Side("concur", "concur", None),
                           memory.parse_args(["--out", "x", "--unsplit-weight-grads"]), None)["unsplit_weight_grads"]


@pytest.mark.parametrize("serial", [False, True])
def test_serial_weight_grads_makes_one_stream_plans_split_and_the_row_says_so(cpu_child, serial):
    from concur.fx import plan

    row = memory.child(dict(_payload("concur_streams1", "concur", 1), serial_weight_grads=serial))
    assert row["outcome"] != "error" and row["serial_weight_grads"] is serial and plan.SERIAL_WEIGHT_GRADS is serial
    assert memory.child(_payload("recipe", "recipe", None))["serial_weight_grads"] is None


@pytest.mark.parametrize("without", [False, True])
def test_without_caller_memory_runs_every_concur_step_without_the_callers_memory_rung_and_the_row_says_so(cpu_child,
                                                                                                         without):
    from concur.training import rungs

    row = memory.child(dict(_payload("concur", "concur", None), without_caller_memory=without))
    assert row["outcome"] != "error" and row["without_caller_memory"] is without
    assert rungs.CALLER_MEMORY_AFTER_OUT_OF_MEMORY is not without  # concur's default: on
    assert memory.child(_payload("recipe", "recipe", None))["without_caller_memory"] is None
    assert memory._payload(memory.Config("googlenet", 64, "unfused"), memory.Side("concur", "concur", None),
                           memory.parse_args(["--out", "x", "--without-caller-memory"]), None)["without_caller_memory"]


def test_the_out_of_memory_trace_records_each_allocation_that_ran_out_with_its_call_and_frames(cpu_child):
    """The allocator's out-of-memory observer (faked: the CPU has no allocator) reports an allocation in the
    second setup call; the row has that call, the size and the innermost frames of the project's files."""
    observers, calls = [], []
    cpu_child.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append)
    setup = memory.setup

    def noting_setup(*a):
        model, batch, loss_fn, optimizer = setup(*a)
        forward = model.forward
        calls.clear()

        def observed(*inputs):
            calls.append(1)
            if len(calls) == 2:
                observers[0](0, 3 * MB, 4000 * MB, 0)
            return forward(*inputs)
        model.forward = observed
        return model, batch, loss_fn, optimizer
    cpu_child.setattr(memory, "setup", noting_setup)
    assert "oom_trace" not in memory.child(_payload("recipe", "recipe", None)) and not observers
    row = memory.child(dict(_payload("recipe", "recipe", None), oom_trace=True))
    assert len(observers) == 1 and len(row["oom_trace"]) == 1
    traced = row["oom_trace"][0]
    assert traced["call"] == 1 and traced["mib"] == 3 and traced["allocated_mib"] == 4000
    assert traced["stack"][-1].startswith("experiments/peers.py") and "_train" in traced["stack"][-3]
    assert not any(f.startswith("tests/") for f in traced["stack"])  # the test's own frames are no project file


def test_a_timm_network_without_timm_is_an_error_row(cpu_child):
    cpu_child.setattr(memory, "setup", sweep_models.cuda_setup)
    cpu_child.setitem(sys.modules, "timm", None)  # import timm now fails as if it were not installed
    row = memory.child(_payload("recipe_alone", "recipe", None, network="hrnet_w18_small"))
    assert (row["outcome"], row["error_type"]) == ("error", "ModuleNotFoundError")
    assert row["error"].startswith("timm not installed")


def test_how_the_step_runs_comes_from_its_status_and_the_graphs_streams_beside_it():
    from concur.training.status import StepStatus

    graphs = {"a": types.SimpleNamespace(streams=4), "b": types.SimpleNamespace(streams=4)}
    status = StepStatus("captured", 1, 4, "the step on 4 streams does not fit in memory", 2, 1, 0,
                        ("the step on 4 streams does not fit in memory",))
    kept = memory._streams_kept(types.SimpleNamespace(graphs=graphs, status=status))
    assert kept["streams"] == 1 and kept["graph_streams"] == [4] and kept["mode"] == "captured"
    assert kept["capture_failures"] == 1 and "does not fit" in kept["why"] and "1 stream of 4" in kept["status"]
    assert "status" not in memory._streams_kept(types.SimpleNamespace(graphs=graphs))


def test_a_compiled_steps_row_has_its_forward_and_backward_graphs_streams_and_the_table_shows_a_narrowed_one():
    """Under memory pressure a compiled step's backward runs fewer streams than its forward: the row and the
    table say so."""
    def info(backward, streams):
        return types.SimpleNamespace(is_backward=backward, num_streams=streams)

    backend = types.SimpleNamespace(graphs=[info(False, 4), info(True, 2), info(False, 1)])
    kept = memory._streams_kept(types.SimpleNamespace(graphs={}, backends={4: backend}))
    assert (kept["forward_streams"], kept["backward_streams"]) == (4, 2)
    assert "backward_streams" not in memory._streams_kept(types.SimpleNamespace(graphs={}, backends={}))
    row = dict(outcome="fit", streams=4, forward_streams=4, backward_streams=2, ms_per_step=7.41)
    assert memory._cell(row, None) == "fit s4 (backward 2) 7.41 ms"
    assert memory._cell(dict(row, backward_streams=4), None) == "fit s4 7.41 ms"


def test_concurs_memory_fallback_warning_is_a_fallback():
    assert memory.FALLBACK.search("concur.train_step: the step on 4 streams does not fit in memory (an allocation "
                                  "of 20.00 MiB did not fit); running it on 1 stream instead, for this and later "
                                  "input shapes.")


def test_the_jsonl_has_a_row_per_run_with_every_field(tmp_path, cpu_child):
    # the children run this process's child function: the rows are what a real child writes
    def answer(payload):
        return memory.child(payload)
    cpu_child.setattr(memory, "_launch", FakeLauncher(answer))
    memory.run(_args(tmp_path, paths=["unfused"]))
    rows = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert [r["side"] for r in rows] == ["recipe_alone", "recipe", "concur", "concur_streams1"]
    fields = {"network", "batch", "path", "side", "who", "streams_requested", "limit", "outcome", "oom", "warnings",
              "fallback_warnings", "ms_per_step", "peak_allocated_mb", "peak_reserved_mb", "setup_peak_allocated_mb",
              "setup_peak_reserved_mb", "steady_peak_allocated_mb", "steady_peak_reserved_mb", "torch", "gpu",
              "date", "concur_loaded", "setup_calls"}
    for row in rows:
        assert fields <= set(row), fields - set(row)
    assert all("streams" in r and "graph_streams" in r for r in rows if r["who"] == "concur")
    assert all("fraction" in r for r in rows[1:]) and "fraction" not in rows[0]


# --- the table and the OOM count ---------------------------------------------------------------------------

def _table_rows() -> list[dict]:
    def row(side, who, **fields):
        p = _payload(side, who, None, path="fused")
        return dict(memory.base_row(p), **fields)
    return [row("recipe_alone", "recipe", outcome="fit", oom=False, peak_allocated_mb=1000.0,
                peak_reserved_mb=2000.0, ms_per_step=3.0),
            row("recipe", "recipe", outcome="fit", oom=False, peak_allocated_mb=1000.0, peak_reserved_mb=2100.0,
                ms_per_step=3.1),
            row("concur", "concur", outcome="error", oom=True, error_type="OutOfMemoryError"),
            row("concur_streams1", "concur", outcome="fallback", oom=False, streams=1, peak_allocated_mb=900.0,
                peak_reserved_mb=1900.0, ms_per_step=2.5)]


def test_the_table_shows_each_side_against_the_recipe_alone():
    lines = memory.table(_table_rows())
    assert lines[0] == ("| network | batch | path | recipe alone: peak reserved MB | recipe | concur "
                        "| concur_streams1 |")
    assert lines[2] == ("| googlenet | 2 | fused | 2000 | fit 3.10 ms 1.00/1.05 | OOM "
                        "| fallback s1 2.50 ms 0.90/0.95 |")


def test_the_last_line_counts_the_out_of_memory_errors():
    rows = _table_rows()
    rows.append(dict(rows[2], network="resnet50", error_type="RuntimeError", oom=True))
    rows.append(dict(rows[1], network="resnet50", outcome="skipped", oom=False))
    last = memory.table(rows)[-1]
    assert last == ("OutOfMemoryError in 2 of 5 runs: recipe_alone 0/1, recipe 0/1, concur 2/2, "
                    "concur_streams1 0/1")


# --- the recipe's processes load nothing of concur ------------------------------------------------------------

_RECIPE_CHILD = """
import json, sys
import torch, torch.nn as nn
from experiments import memory, peers
MB = 2**20
memory._device = lambda: ("Fake GPU", 8000 * MB)
memory._set_limit = lambda f: None
memory._peaks = memory._held = lambda: (MB, MB)
memory._reset_peaks = lambda: None
memory._ms_per_step = lambda fn, steps: [fn() for _ in range(steps)] and 1.0
memory.setup = lambda name, b: (nn.Sequential(nn.Flatten(), nn.Linear(12, 10)), (torch.randn(b, 3, 2, 2),
    torch.randint(0, 10, (b,))), nn.CrossEntropyLoss(), lambda ps: torch.optim.SGD(ps, lr=0.01))
for name in memory.RECIPE_OF_PATH.values():
    peers.RECIPES[name] = peers.eager_step  # the plain loop: what runs on the CPU
payload = json.loads(sys.argv[1])
row = memory.child(payload)
print(json.dumps([row["outcome"], row["concur_loaded"],
                  sorted(m for m in sys.modules if m == "concur" or m.startswith("concur."))]))
"""


@pytest.mark.parametrize("who", ["recipe", "concur"])
def test_the_recipes_child_loads_nothing_of_concur(who):
    """In a fresh interpreter, the child's whole path for the recipe, its CUDA calls stood in for; concur's side
    shows that the check sees concur where it is loaded."""
    payload = _payload(who, who, 1 if who == "concur" else None, limit_bytes=MB)
    env = dict(os.environ, PYTHONPATH=str(memory.REPO))
    out = subprocess.run([sys.executable, "-c", _RECIPE_CHILD, json.dumps(payload)], capture_output=True,
                         text=True, env=env, cwd=memory.REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    outcome, loaded, modules = json.loads(out.stdout.strip().splitlines()[-1])
    if who == "recipe":
        assert (outcome, loaded, modules) == ("fit", False, [])
    else:
        assert outcome == "fallback" and loaded and "concur" in modules


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the child would run the real network")
def test_a_real_child_runs_from_any_folder_and_its_row_comes_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    row = memory.run_child(_payload("recipe_alone", "recipe", None), timeout_s=300)
    assert row["error_type"] == "RuntimeError" and "needs a CUDA device" in row["error"]  # a row, not a crash
    assert row["exit_code"] == 0 and row["concur_loaded"] is False


def test_kernels_profile_each_side_after_its_timed_steps_and_keep_the_slowest(cpu_child):
    """``--kernels N``: the row names the N kernels that took the most device time per step; off by default."""
    profiled = []

    def profile(fn, steps, n):
        profiled.append((steps, n))
        fn()
        return [dict(kernel="k", us_per_step=1.0, calls_per_step=1.0)]

    cpu_child.setattr(memory, "profile_kernels", profile)
    assert "top_kernels" not in memory.child(_payload("recipe", "recipe", None)) and not profiled
    row = memory.child({**_payload("recipe", "recipe", None), "kernels": 3})
    assert profiled == [(memory.PROFILED_STEPS, 3)] and row["top_kernels"][0]["kernel"] == "k"
    assert memory.parse_args(["--out", "x", "--kernels", "4"]).kernels == 4
    assert memory.parse_args(["--out", "x"]).kernels == 0


def test_a_concur_row_has_what_the_step_held_at_each_failed_attempt(monkeypatch):
    """Each failed setup attempt records the allocator's breakdown before its memory is given back."""
    from concur.training import graph_runner

    given_back = []
    monkeypatch.setattr(graph_runner.CudaGraphRunner, "failed", lambda self: given_back.append(self))
    monkeypatch.setattr(memory, "breakdown", lambda: {"pool0.1 stream0": [10.0, 2.0]})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    row: dict = {}
    memory._record_failures(row)
    runner = object.__new__(graph_runner.CudaGraphRunner)
    graph_runner.CudaGraphRunner.failed(runner)
    graph_runner.CudaGraphRunner.failed(runner)
    assert row["held_at_failures"] == [{"pool0.1 stream0": [10.0, 2.0]}] * 2 and given_back == [runner, runner]


def test_the_caller_outputs_probe_runs_only_where_asked_and_the_row_says_so(cpu_child, monkeypatch):
    """CONCUR_PROBE_CALLER_OUTPUTS=1 patches the plan's stream runtime in a concur child and its row counts what the
    probe moved (nothing on the CPU: no side stream); without it, neither."""
    from concur import streams
    from experiments import caller_outputs

    for name in ("__init__", "fork", "_leave_mode"):  # patched: restored after
        monkeypatch.setattr(streams.StreamRuntime, name, getattr(streams.StreamRuntime, name))
    monkeypatch.delattr(streams.StreamRuntime, "_probe_originals", raising=False)
    fork, init = streams.StreamRuntime.fork, streams.StreamRuntime.__init__
    assert memory.PROBE_ENV == caller_outputs.ENV  # memory.py imports the probe in concur's children only
    row = memory.child(_payload("concur", "concur", None))
    assert "caller_outputs" not in row and streams.StreamRuntime.fork is fork
    monkeypatch.setenv(caller_outputs.ENV, "1")
    row = memory.child(_payload("concur", "concur", None))
    assert row["outcome"] != "error" and row["caller_outputs"] == {"form": "outputs"}
    assert streams.StreamRuntime.fork is not fork and streams.StreamRuntime.__init__ is init
    assert len(row["losses"]) == 2 and all(math.isfinite(loss) for loss in row["losses"])
    monkeypatch.setenv(caller_outputs.ENV, "backward-on-caller")
    row = memory.child(_payload("concur", "concur", None))
    assert row["caller_outputs"] == {"form": "backward-on-caller"}
    assert streams.StreamRuntime.fork is fork  # installed again: from the runtime's own methods
    assert streams.StreamRuntime(2, 0).caller_memory and not streams.StreamRuntime(1, 0).caller_memory
    monkeypatch.setenv(caller_outputs.ENV, "backwards")
    assert memory.child(_payload("concur", "concur", None))["outcome"] == "error"


class _Deciding:
    """A concur step stand-in whose trials run while ``deciding``: call 0 starts one that ends after call 3; call
    4 captures the program kept and, that not fitting, starts a narrower rung's, which ends after call 7."""

    def __init__(self):
        self.calls, self.captures = 0, 0

    @property
    def deciding(self) -> bool:
        return 1 <= self.calls <= 3 or 5 <= self.calls <= 7

    @property
    def status(self):
        import types
        return types.SimpleNamespace(captures=self.captures, failures=0, streams=1, fallbacks=[])

    def __call__(self, *batch):
        self.captures += self.calls in (0, 4, 8)
        self.calls += 1
        return torch.tensor(1.0)


def test_setup_runs_on_while_the_capture_of_the_kept_program_started_another_trial(cpu_child):
    """And with the out-of-memory trace on, the row logs the calls that captured (faked observer: no allocator)."""
    steps = []
    cpu_child.setattr(torch._C, "_cuda_attach_out_of_memory_observer", lambda observer: None)
    cpu_child.setattr(memory, "_concur_step", lambda *a, **k: steps.append(_Deciding()) or steps[-1])
    row = memory.child(dict(_payload("concur", "concur", None), oom_trace=True))
    assert row["setup_calls"] == 9 and not row["still_deciding"], "the second trial and its capture are setup"
    assert [c["call"] for c in row["call_log"]] == [0, 4, 8] and row["call_log"][-1]["captures"] == 3
    assert steps[0].deciding is False and len(row["losses"]) == _payload("concur", "concur", None)["steps"]

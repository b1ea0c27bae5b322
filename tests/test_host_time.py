"""experiments/host_time.py on the host: its replay stamps, its rows and table, and its arguments."""

import json
import re

import pytest
import torch

from experiments import host_time


def test_replay_stamps_time_the_launch_and_restore_the_method(monkeypatch):
    launched = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: launched.append(graph))
    original = torch.cuda.CUDAGraph.replay
    with host_time.ReplayStamps() as stamps:
        assert stamps.last is None
        torch.cuda.CUDAGraph.replay("graph")
        assert launched == ["graph"] and stamps.last is not None, "the wrapper stamps, then launches"
    assert torch.cuda.CUDAGraph.replay is original


def test_cpu_rows_have_each_side_with_its_host_time(tmp_path, capsys):
    out = tmp_path / "host.jsonl"
    host_time.main(["--device", "cpu", "--model", "branchy:2x8", "--batch", "2", "--rounds", "2", "--calls", "2",
                    "--streams", "1", "2", "--profile", "1", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["side"] for r in rows] == ["recipe", "concur_streams1", "concur_streams2"]
    for r in rows:
        assert r["host_us"] > 0 and r["before_replay_us"] is None and r["synced_ms"] is None, \
            "on a CPU nothing is captured: the call's host time only"
        assert r["host_ops"] and all(op["self_cpu_us_per_call"] >= 0 for op in r["host_ops"])
    table = capsys.readouterr().out
    assert "| recipe |" in table and "| concur_streams2 |" in table and "aten::" in table


def test_python_functions_are_listed_by_their_own_time(tmp_path):
    out = tmp_path / "host.jsonl"
    host_time.main(["--device", "cpu", "--model", "branchy:2x8", "--batch", "2", "--rounds", "1", "--calls", "1",
                    "--streams", "2", "--python", "2", "--json", str(out)])
    rows = {r["side"]: r for r in map(json.loads, out.read_text().splitlines())}
    functions = rows["concur_streams2"]["python_functions"]
    assert functions and all(f["cumulative_us_per_call"] >= f["self_cpu_us_per_call"] >= 0 for f in functions)
    own = [f["self_cpu_us_per_call"] for f in functions]
    assert own == sorted(own, reverse=True) and len(functions) <= 15
    assert all(re.fullmatch(r"[^:]+:\d+\(.+\)", f["name"]) and f["count_per_call"] > 0 for f in functions), \
        "each named by file, line and function, as cProfile counts them"


@pytest.mark.parametrize("streams", ["0", "two"])
def test_bad_stream_counts_are_refused(streams):
    with pytest.raises(SystemExit, match="--streams takes positive integers or auto"):
        host_time.main(["--device", "cpu", "--streams", streams])

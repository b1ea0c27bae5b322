"""experiments/host_time.py on the host: its replay stamps, its rows and table, and its arguments."""

import json

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


@pytest.mark.parametrize("streams", ["0", "two"])
def test_bad_stream_counts_are_refused(streams):
    with pytest.raises(SystemExit, match="--streams takes positive integers or auto"):
        host_time.main(["--device", "cpu", "--streams", streams])

"""experiments/capture_wrappers.py on the CPU: the command writes one wrapper set per graph, each with inductor's own
read/write oracle beside it (the golden fixtures' format, tests/test_golden_wrappers.py reads them)."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments import capture_wrappers

pytestmark = pytest.mark.inductor  # compiles through inductor: CI runs it as its own tier


def test_a_cpu_capture_writes_wrapper_oracle_and_meta_for_forward_and_backward(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # no cache may skip the scheduler
    assert capture_wrappers.main(["--device", "cpu", "--models", "branchy", "--precisions", "fp32", "--batch", "2",
                                  "--no-compile-cpp", "--out", str(tmp_path / "out")]) == 0
    written = sorted(p for p in (tmp_path / "out").glob("*/branchy_fp32_*"))
    assert [p.name for p in written] == ["branchy_fp32_bwd", "branchy_fp32_fwd"]
    for d in written:
        assert {p.name for p in d.iterdir()} >= {"wrapper.py.gz", "oracle.json.gz", "meta.json"}
        assert "def call(" in gzip.decompress((d / "wrapper.py.gz").read_bytes()).decode()
        assert json.loads(gzip.decompress((d / "oracle.json.gz").read_bytes()))
        assert json.loads((d / "meta.json").read_text())["model"] == "branchy"
    assert capsys.readouterr().out.count("wrote ") == 2


def test_an_unknown_model_is_refused_by_name(tmp_path):
    with pytest.raises(KeyError, match="nonet"):
        capture_wrappers.main(["--device", "cpu", "--models", "nonet", "--out", str(tmp_path)])

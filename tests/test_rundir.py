"""concur.rundir: a run directory round-trips through run.json, paths are slugs, a partial run is readable."""

from __future__ import annotations

import json

import pytest

from concur.observe.rundir import RUN_FILE, Run, RunWriter, Variant, load_run, slug


def test_slugs_are_file_name_safe():
    assert slug("GoogLeNet b8") == "googlenet_b8"
    assert slug("  Inception-v3 / bf16 (b32) ") == "inception_v3_bf16_b32"


def test_a_run_round_trips_through_run_json(tmp_path):
    writer = RunWriter(tmp_path / "run", meta={"gpu": "H100", "torch": "2.11"})
    case = writer.case("GoogLeNet b8", model="googlenet", batch=8)
    case.variants += [Variant("eager", role="eager", median_ms=22.4), Variant("4 streams", streams=4,
                                                                             cuda_graph=True, median_ms=3.8)]
    monitor = writer.monitor_path(case)
    trace = writer.trace_path(case, "4 streams")
    writer.trace_path(case, "4 streams", mode="eager")  # the same label again replaces the first
    path = writer.save()
    assert path == tmp_path / "run" / RUN_FILE and not path.with_suffix(".tmp").exists()
    assert monitor == tmp_path / "run/monitor/googlenet_b8.json"
    assert trace == tmp_path / "run/traces/googlenet_b8_4_streams.json.gz" and trace.parent.is_dir()
    run = load_run(tmp_path / "run")
    assert run == writer.run and run.meta == {"gpu": "H100", "torch": "2.11"}
    [loaded] = run.cases
    assert loaded.variant("eager").median_ms == 22.4 and loaded.variant("tuned") is None
    assert [(t.label, t.mode) for t in loaded.traces] == [("4 streams", "eager")]


def test_every_save_rewrites_the_whole_run_so_a_cut_run_still_reads(tmp_path):
    writer = RunWriter(tmp_path)
    writer.case("a")
    writer.save()
    writer.case("b")
    assert [c.name for c in load_run(tmp_path).cases] == ["a"]  # what was saved before the cut
    writer.save()
    assert [c["name"] for c in json.loads((tmp_path / RUN_FILE).read_text())["cases"]] == ["a", "b"]


def test_loading_a_directory_without_run_json_says_what_it_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="a run directory written by an experiment"):
        load_run(tmp_path)
    assert Run.from_dict({}) == Run()

"""experiments/setup_cost.py's pairs on the host: each setup reported as it ends, with what it decided."""

import json

from experiments import setup_cost


def test_each_setup_is_printed_as_it_ends_with_its_phases_and_decisions(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_child(args, measure, cache):
        calls.append(measure)
        n = len(calls)
        return {"first": 20.0 + n, "through": 20.5 + n, "build": 1.0, "decisions_code": 2.0 if measure else 1.5,
                "decisions": [{"what": "the forward graph", "keep": measure, "num_streams": 4, "rounds": 3}]}

    monkeypatch.setattr(setup_cost, "_child", fake_child)
    out = tmp_path / "setup.jsonl"
    setup_cost.main(["--pairs", "2", "--compile", "--streams", "auto", "--json", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert calls == [False, True, False, True, False, True]  # cold off, cold on, then off/on alternating
    # one line per setup before the summary: a deadline that cuts the pairs short keeps what ran
    assert lines[0] == ("cold off: setup 21.00 s, through 40 calls 21.50 s; build 1.00 s, decisions' code "
                        "1.50 s; decisions: dropped 4 in 3 rounds")
    assert lines[3].startswith("on 0: setup 24.00 s") and lines[3].endswith("decisions: kept 4 in 3 rounds")
    assert len(lines) == 7 and lines[6].startswith("googlenet b32 fused streams=auto: setup 24.00 s without")
    record = json.loads(out.read_text())
    assert record["off_s"] == 24.0 and record["on_s"] == 25.0  # medians of (23, 25) and (24, 26)
    assert set(record["runs"]) == {"cold off", "cold on", "off 0", "on 0", "off 1", "on 1"}


def test_a_child_reports_the_decisions_its_cache_holds(monkeypatch, tmp_path):
    decisions = tmp_path / "decisions"
    decisions.mkdir()
    (decisions / "a.json").write_text(json.dumps({"format": 1, "result": {
        "what": "the backward graph", "keep": False, "num_streams": 3, "rounds": 7, "one_stream_ms": 1.0}}))
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))

    def fake_one(args, phases=None):
        phases["build"] = 0.5
        return 10.0, 11.0

    monkeypatch.setattr(setup_cost, "_one", fake_one)
    monkeypatch.setattr(setup_cost._Counted, "decisions_code", lambda self: None)  # no concur patched here
    seen = setup_cost._child_run(None)
    assert seen == {"first": 10.0, "through": 11.0, "build": 0.5, "decisions_code": 0.0,
                    "decisions": [{"what": "the backward graph", "keep": False, "num_streams": 3, "rounds": 7}]}

"""experiments/zoo_decisions.py: the zoo's table from a run directory, on a made-up run."""

from __future__ import annotations

import json

from concur.dag.disk_cache import JsonCache
from experiments import zoo_decisions


def _decision(what, one, many, keep, predicted, scope=None):
    entry = {"keep": keep, "one_stream_ms": one, "streams_ms": many, "rounds": 7, "predicted_speedup": predicted,
             "what": what}
    return entry if scope is None else dict(entry, scope=scope)


def test_the_table_puts_each_network_beside_its_decisions_slowest_first(tmp_path, capsys):
    rows = [dict(model=m, batch=32, precision="bf16", mode=mode, status=status, ms=ms, key=f"{m}|32|bf16|{mode}")
            for m, mode, status, ms in (("timm:fast", "peer_compile_graph", "ok", 6.0),
                                        ("timm:fast", "fused:4", "ok", 5.0),
                                        ("slow", "peer_compile_graph", "ok", 4.0), ("slow", "fused:4", "ok", 4.0),
                                        ("broken", "fused:4", "error", None),
                                        ("slow", "peer_eager_graph", "ok", 5.0), ("slow", "concur_graph:4", "ok", 4.0))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fast = JsonCache(tmp_path / "decisions" / "timm-fast_32_bf16_fused-4")
    fast.put("f", _decision("the forward graph of 10 ops (4 launches)", 1.0, 0.8, True, 1.3))
    fast.put("b", _decision("the backward graph of 20 ops (9 launches)", 2.0, 2.1, False, 1.1, scope="graph"))
    fast.put("s", _decision("the forward and backward of Fast (1 graph on streams)", 3.0, 2.5, True, 1.2))  # no scope
    slow = JsonCache(tmp_path / "decisions" / "slow_32_bf16_fused-4")
    slow.put("s", _decision("the forward and backward of Slow", 3.0, 3.1, False, 1.05, scope="step"))
    unfused = JsonCache(tmp_path / "decisions" / "slow_32_bf16_concur_graph-4")
    unfused.put("s", _decision("concur.optimize of Slow, timed on the step's first calls", 5.0, 4.0, True, 1.1,
                               scope="step"))
    out = tmp_path / "all.jsonl"

    assert zoo_decisions.main([str(tmp_path), "--jsonl", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("| slow | 32 | fused | 4.00 | 4.00 | **1.000x** | 1, not timed | 1, not timed | "
                        "dropped, 0.97x (1.05x) |")
    assert lines[3] == ("| fast | 32 | fused | 6.00 | 5.00 | **1.200x** | 4, 1.25x (1.30x) | 1, 0.95x (1.10x) | "
                        "kept, 1.20x (1.20x) |")
    # the unfused route: concur's unfused step against the eager whole-step capture, its trial's decision beside it
    assert lines[4] == ("| slow | 32 | unfused | 5.00 | 4.00 | **1.250x** | — | — | "
                        "kept, 1.25x (1.10x) |")
    assert len(lines) == 5  # the errored network has no row
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((d["config"], d["scope"]) for d in written) == [
        ("slow_32_bf16_concur_graph-4", "step"), ("slow_32_bf16_fused-4", "step"),
        ("timm-fast_32_bf16_fused-4", "graph"),
        ("timm-fast_32_bf16_fused-4", "graph"), ("timm-fast_32_bf16_fused-4", "step")]


def test_below_names_each_network_and_route_under_the_ratio_for_a_run_alone(tmp_path, capsys):
    rows = [dict(model=m, batch=32, precision="bf16", mode=mode, status="ok", ms=ms, key=f"{m}|32|bf16|{mode}")
            for m, mode, ms in (("timm:slow", "peer_compile_graph", 4.0), ("timm:slow", "fused:4", 4.2),
                                ("timm:slow", "peer_eager_graph", 5.0), ("timm:slow", "concur_graph:4", 5.0),
                                ("fast", "peer_eager_graph", 5.0), ("fast", "concur_graph:4", 4.0))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert zoo_decisions.below(tmp_path, 0.99) == [("timm:slow", "fused")]
    assert zoo_decisions.below(tmp_path, 1.01) == [("timm:slow", "fused"), ("timm:slow", "unfused")]
    assert zoo_decisions.main([str(tmp_path), "--below", "0.99"]) == 0
    assert capsys.readouterr().out.splitlines() == ["timm:slow fused"]
    # none below: no output at all, where an empty line would send zoo.sh to time a network named ''
    assert zoo_decisions.main([str(tmp_path), "--below", "0.5"]) == 0
    assert capsys.readouterr().out == ""

"""The fused route's host work per graph: reading a wrapper and emitting its programs, counted in Python calls.

Setup pays this once per candidate program of every compiled graph, before
anything runs on a GPU (``streams="auto"`` builds up to three per graph).
Equality tests cannot see it, so it is counted: the Python function calls
one step makes (deterministic, unlike wall time), against bounds per
statement of GoogLeNet's bf16 backward on the H100 (torch 2.11, 2362
statements, 397 launches). An emission that deep-copied every statement
per program, or filtered the launches again per host statement, would make
about 1950 calls per statement, a second or more per program.
"""

from __future__ import annotations

import ast
import gzip
import sys
from pathlib import Path

from concur.dag import decide
from concur.inductor.wrapper_build import build_call
from concur.inductor.wrapper_emit import launch_dag, plan_emission
from concur.inductor.wrapper_parse import parse_wrapper, source_namespace

WRAPPER = Path(__file__).parent / "fixtures" / "wrappers" / "torch2.11.0-cuda" / "googlenet_bf16_cl_bwd" / "wrapper.py.gz"


def _counted(fn):
    """(Python calls ``fn()`` made, its result)."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(previous)
    return calls[0], result


def test_reading_planning_and_building_a_program_cost_calls_in_proportion_to_the_wrapper():
    source = gzip.open(WRAPPER, "rt").read()
    namespace = source_namespace(source)
    parse_calls, program = _counted(lambda: parse_wrapper(source, namespace, split_reuses=True))
    n = len(program.statements)
    dag = launch_dag(program, {}, 1.0)
    schedule = decide.schedule_graph(dag, 4, "critical_path", 2.0)
    plan_calls, plan = _counted(lambda: plan_emission(program, schedule, dag))
    build_calls, _ = _counted(lambda: build_call(program, plan, dict(namespace)))
    assert n > 2000 and plan.num_streams == 4
    assert parse_calls < 700 * n, parse_calls     # about 1.2M calls: no generator per ast.walk node
    assert plan_calls < 40 * n, plan_calls        # about 48k: linear in the statements
    assert build_calls < 40 * n, build_calls      # about 52k: statements shared, never deep-copied


def test_building_programs_shares_the_wrappers_nodes_and_leaves_them_as_they_were():
    """A built call reuses the parsed statements instead of copying them; nothing it does may change them."""
    source = gzip.open(WRAPPER, "rt").read()
    namespace = source_namespace(source)
    program = parse_wrapper(source, namespace, split_reuses=True)
    dag = launch_dag(program, {}, 1.0)
    before = ast.dump(program.function, include_attributes=True)
    statements = [ast.dump(s.node, include_attributes=True) for s in program.statements]
    for streams in (2, 4):
        plan = plan_emission(program, decide.schedule_graph(dag, streams, "critical_path", 2.0), dag)
        call, runtime = build_call(program, plan, namespace)
        assert callable(call) and runtime.num_streams == streams
    assert ast.dump(program.function, include_attributes=True) == before
    assert [ast.dump(s.node, include_attributes=True) for s in program.statements] == statements


def test_a_statement_made_without_a_position_is_copied_and_located_not_changed():
    from concur.inductor.wrapper_build import _shared

    parsed = ast.parse("x = y + 1").body[0]
    assert _shared(parsed) is parsed
    made = ast.Delete(targets=[ast.Name(id="x", ctx=ast.Del())])
    located = _shared(made)
    assert located is not made and not hasattr(made, "lineno") and located.lineno == located.targets[0].lineno == 1
    compile(ast.Module(body=[located], type_ignores=[]), "<test>", "exec")


def test_the_emission_cost_script_times_each_step_of_a_golden_wrapper(tmp_path, capsys):
    import json

    from experiments import emit_cost

    out = tmp_path / "cost.jsonl"
    assert emit_cost.main(["--match", "googlenet_bf16_cl_fwd", "--repeats", "1", "--json", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["wrapper"] == "torch2.11.0-cuda/googlenet_bf16_cl_fwd" and row["candidates"] >= 1
    assert all(row[k] >= 0 for k in ("parse_s", "schedule_s", "plan_s", "build_s"))
    assert "| torch2.11.0-cuda/googlenet_bf16_cl_fwd |" in capsys.readouterr().out

"""Golden wrappers: real inductor output, parsed by concur.inductor.wrapper_parse, checked against inductor's scheduler.

Each folder under ``tests/fixtures/wrappers/<torch>-<device>/`` holds one
graph captured by ``experiments/capture_wrappers.py``: the wrapper module
inductor generated and, as the oracle, what inductor's own scheduler said
each scheduled node reads and writes (``read_writes``, taken inside
``Scheduler.codegen``, never from the wrapper text). The parser must not
miss a write: every buffer a node writes must be in the write set of the
launch that implements it, as a storage group (a reused buffer,
``buf9 = buf5  # reuse``, or a ``reinterpret_tensor`` view is the group of
its storage), and every buffer it reads must be in that launch's reads or
writes. Extra writes are allowed (the parser fails closed).

Which launch implements a node is found from the buffers, not from the fx
origins: the "Source Nodes" comments are missing above some launches (torch
2.11 writes ``Unsorted Source Nodes: []`` for layout copies) and kernel names
change between versions, while buffer names are the scheduler's own in every
version checked (2.11, 2.13, 2.14.1, 2.15.0). For each buffer a node writes that the
wrapper names:

- bound by a launch (``buf3 = extern_kernels.convolution(...)``): that launch;
- bound by a subscript (``buf5 = buf4[0]``): a multi-output view, no launch;
- otherwise (allocated, reused, or a view of a larger buffer): the first
  launch after the binding that touches the buffer's storage group.

A node that mutates an input in place (``copy_`` of batch-norm statistics)
writes a mutation buffer the wrapper never names; its launch is one that uses
the mutated name between the launches of the nodes before and after it,
preferring one strictly between (on CPU it is often a neighbour's own
kernel). ``NopKernel``
nodes (a ``cat`` whose inputs write into slices) emit nothing. Every other
node must map to exactly one launch, and every launch to a node (on CUDA to
exactly one; inductor's C++ backend emits consecutive nodes as one kernel);
the number of launches is also checked against the kernel calls counted in
the wrapper's text. Buffers a fused kernel keeps in registers never appear in
the wrapper and are skipped.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from concur.dag.annotate import RNG
from concur.inductor.wrapper_parse import TESTED_TORCH_VERSIONS, parse_wrapper_source
from concur.inductor.wrapper_program import WORLD, KernelProgram, Statement

FIXTURES = Path(__file__).parent / "fixtures" / "wrappers"
GRAPHS = sorted(p.parent for p in FIXTURES.glob("*/*/wrapper.py.gz"))
EXPECTED_BARRIERS: dict[str, int] = {}  # "<torch>-<device>/<graph>": barriers that are understood; none so far


def graph_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


@dataclass
class Golden:
    """One fixture graph: the parsed wrapper and the scheduler's nodes, with each node's launch."""

    program: KernelProgram
    nodes: list[dict]
    launch_of: dict[str, int | None] = field(default_factory=dict)   # node name -> statement position
    problems: list[str] = field(default_factory=list)
    group_before: list[dict[str, str]] = field(default_factory=list)  # name -> storage group before each statement
    real_name: dict[str, str] = field(default_factory=dict)           # mutation buffer -> what it mutates
    named: set[str] = field(default_factory=set)                      # every name the call function uses or binds
    source: str = ""


@functools.lru_cache(maxsize=None)
def load(path: Path) -> Golden:
    return read_golden(path)


@pytest.fixture(autouse=True, scope="module")
def parsed_wrappers_freed_after_this_module():
    """The parsed wrappers are millions of objects: kept for the rest of the session, every later
    full ``gc.collect()`` (a failed capture's cleanup runs one) would walk them, about 2 s each on 2 cores."""
    yield
    load.cache_clear()


def read_golden(path: Path) -> Golden:
    source = gzip.open(path / "wrapper.py.gz", "rt").read()
    records = json.load(gzip.open(path / "oracle.json.gz", "rt"))
    program = parse_wrapper_source(source)
    golden = Golden(program, [n for r in records for n in r["nodes"]], source=source)
    for record in records:
        renames = record["mutation_renames"]  # old name -> the buffer that mutated it
        for _ in range(len(renames) + 1):
            changed = False
            for old, new in renames.items():
                real = golden.real_name.get(old, old)
                if golden.real_name.get(new) != real:
                    golden.real_name[new] = real
                    changed = True
            if not changed:
                break
    state = {name: name for name in program.inputs}
    for s in program.statements:
        golden.group_before.append(dict(state))
        golden.named |= s.uses | s.binds
        if s.bind_group is not None and len(s.binds) == 1:
            state[next(iter(s.binds))] = s.bind_group
    golden.named |= set(program.inputs)
    _map_nodes(golden)
    return golden


def _map_nodes(golden: Golden) -> None:
    statements = golden.program.statements
    first_bind: dict[str, int] = {}
    for i, s in enumerate(statements):
        for name in s.binds:
            first_bind.setdefault(name, i)
    mutating_only = []
    for node in golden.nodes:
        if node["type"] == "NopKernelSchedulerNode":
            continue
        outputs = [w for w in node["writes"] if w in golden.named]
        launches, views = set(), 0
        for buffer in outputs:
            i = first_bind.get(buffer)
            if i is None:
                golden.problems.append(f"{node['name']}: {buffer} is used but never bound")
                continue
            bound = statements[i]
            if bound.is_launch:
                launches.add(i)
            elif isinstance(bound.node, ast.Assign) and isinstance(bound.node.value, ast.Subscript):
                views += 1
            else:
                after = next((j for j in range(i + 1, len(statements))
                              if statements[j].is_launch and bound.bind_group in statements[j].groups), None)
                if after is None:
                    golden.problems.append(f"{node['name']}: no launch touches {buffer} after it is bound")
                else:
                    launches.add(after)
        if not outputs and node["mutations"]:
            mutating_only.append(node)
            continue
        if not launches:
            if not (outputs and views == len(outputs)):
                golden.problems.append(f"{node['name']} ({node['type']}) maps to no launch")
            golden.launch_of[node["name"]] = None
            continue
        if len(launches) > 1:
            golden.problems.append(f"{node['name']} maps to several launches {sorted(launches)}")
            continue
        (golden.launch_of[node["name"]],) = launches
    order = {node["name"]: k for k, node in enumerate(golden.nodes)}
    for node in mutating_only:  # between the launches of the nodes around it, preferring one of its own
        k = order[node["name"]]
        before = max((i for n, i in golden.launch_of.items() if i is not None and order[n] < k), default=0)
        after = min((i for n, i in golden.launch_of.items() if i is not None and order[n] > k),
                    default=len(statements) - 1)
        uses = [j for j in range(before, after + 1)
                if statements[j].is_launch and set(node["mutations"]) & statements[j].uses]
        inside = [j for j in uses if before < j < after]
        if not uses:
            golden.problems.append(f"{node['name']} mutates {node['mutations']} but no launch near it uses them")
            continue
        golden.launch_of[node["name"]] = (inside or uses)[0]


def groups_at(golden: Golden, i: int) -> dict[str, str]:
    """Name -> storage group as the launch at position ``i`` sees it (with the name it binds)."""
    launch = golden.program.statements[i]
    state = dict(golden.group_before[i])
    if launch.bind_group is not None and len(launch.binds) == 1:
        state[next(iter(launch.binds))] = launch.bind_group
    return state


def test_tested_range_covers_the_fixtures():
    versions = {p.parent.name.split("-")[0].removeprefix("torch") for p in GRAPHS}
    assert versions and versions <= set(TESTED_TORCH_VERSIONS)


def test_every_tested_version_has_golden_cuda_wrappers_and_the_backends_releases_are_theirs():
    """Each tested torch has real CUDA wrappers (an H100's, or generated on the CPU), and CPU ones from 2.13 on."""
    from concur._torch_compat import TESTED_TORCH

    sets = {p.parent.name for p in GRAPHS}
    for version in TESTED_TORCH_VERSIONS:
        assert {f"torch{version}-cuda", f"torch{version}-cuda-codegen"} & sets, f"no CUDA wrappers of {version}"
        if tuple(int(x) for x in version.split(".")[:2]) >= (2, 13):
            assert f"torch{version}-cpu" in sets, f"no CPU wrappers of {version}"
    assert TESTED_TORCH == {tuple(int(x) for x in v.split(".")[:2]) for v in TESTED_TORCH_VERSIONS}


@pytest.mark.parametrize("path", GRAPHS, ids=graph_id)
def test_every_scheduled_node_maps_to_one_launch_and_back(path):
    golden = load(path)
    assert not golden.problems, golden.problems[:5]
    mapped = [i for i in golden.launch_of.values() if i is not None]
    if "-cuda" in path.parent.name:  # on CPU consecutive nodes share one C++ kernel (a kernel group)
        assert len(mapped) == len(set(mapped)), "two scheduler nodes map to one launch"
    launches = {i for i, s in enumerate(golden.program.statements) if s.is_launch and not is_alignment_copy(s)}
    unmapped = sorted(launches - set(mapped))
    assert not unmapped, [ast.unparse(golden.program.statements[i].node)[:80] for i in unmapped[:5]]


@pytest.mark.parametrize("path", GRAPHS, ids=graph_id)
def test_no_write_or_read_of_the_scheduler_is_missing(path):
    golden = load(path)
    missing, checked = missing_accesses(golden)
    assert not missing, missing[:5]
    assert checked >= len(golden.program.launches)  # the check saw at least one buffer per launch


def test_the_oracle_check_catches_a_parser_that_drops_a_write(monkeypatch):
    """A parser that forgot ``in_out_ptr`` writes (fused in-place kernels) must fail the golden check."""
    import concur.inductor.kernel_signatures as kp

    real = kp._triton_signature

    def forgetful(*args):
        sig = real(*args)
        return sig and kp.KernelSignature(sig.params, frozenset(p for p in sig.written if "in_out" not in p))

    monkeypatch.setattr(kp, "_triton_signature", forgetful)
    path = FIXTURES / "torch2.11.0-cuda" / "resnet50_fp32_fwd"
    missing, _ = missing_accesses(read_golden(path))
    assert any(" writes " in m for m in missing), "the dropped in_out_ptr writes went unnoticed"


def is_alignment_copy(statement: Statement) -> bool:
    """``x = copy_if_misaligned(x)``: inductor's wrapper realigning an input (torch >= 2.14), no scheduler node."""
    value = getattr(statement.node, "value", None)
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "copy_if_misaligned"


def missing_accesses(golden: Golden) -> tuple[list[str], int]:
    """Return (what the scheduler says a node accesses but its launch does not, how many accesses were checked)."""
    missing, checked = [], 0
    for node in golden.nodes:
        i = golden.launch_of.get(node["name"])
        if i is None:
            continue
        launch: Statement = golden.program.statements[i]
        state = groups_at(golden, i)
        for buffer in sorted({w for w in node["writes"] if w in golden.named} | set(node["mutations"])):
            group = state.get(buffer)
            checked += 1
            if group is None or group not in launch.writes:
                missing.append(f"{node['name']} writes {buffer} ({group}); launch writes {sorted(launch.writes)}: "
                               f"{ast.unparse(launch.node)[:80]}")
        for buffer in node["reads"]:
            real = golden.real_name.get(buffer, buffer)
            if real not in golden.named:
                continue  # kept in registers by a fused kernel, never a storage
            group = state.get(real)
            checked += 1
            if group is None or group not in launch.reads | launch.writes:
                missing.append(f"{node['name']} reads {buffer} as {real} ({group}): {ast.unparse(launch.node)[:80]}")
    return missing, checked


# a kernel launch as it appears in a wrapper line, counted from the text alone
_LAUNCH_LINE = re.compile(r"^\s+(?:\w+ = )?(?:\w+\.run\(|cpp_fused_\w+\(|extern_kernels\.\w+\(|"
                          r"torch\.ops\.\w+\.\w+\.\w+\(|aten\.\w+\.\w+\(|\w+\.zero_\(\)|copy_if_misaligned\()")


@pytest.mark.parametrize("path", GRAPHS, ids=graph_id)
def test_wrapper_parses_with_only_expected_barriers_and_every_launch(path):
    golden = load(path)
    barriers = [ast.unparse(s.node)[:80] for s in golden.program.statements if s.kind == "barrier"]
    assert len(barriers) == EXPECTED_BARRIERS.get(graph_id(path), 0), barriers[:5]
    call = golden.source[golden.source.index("def call("):]
    call = call[:call.index("\n\n\n")] if "\n\n\n" in call else call
    assert len(golden.program.launches) == sum(1 for line in call.splitlines() if _LAUNCH_LINE.match(line))


@pytest.mark.parametrize("path", GRAPHS, ids=graph_id)
def test_failing_closed_costs_no_ordering_on_real_wrappers(path):
    """No launch writes a storage its nodes do not: an extra write is safe but orders launches for nothing.

    Not a correctness check (extra writes are allowed) but a guard on what
    failing closed costs: on every real wrapper the parser's write sets are
    exactly the scheduler's, so a change that makes them coarser shows here.
    """
    golden = load(path)
    expected: dict[int, set[str]] = {}
    for node in golden.nodes:
        i = golden.launch_of.get(node["name"])
        if i is None:
            continue
        state = groups_at(golden, i)
        for buffer in set(node["writes"]) | set(node["mutations"]):
            group = state.get(golden.real_name.get(buffer, buffer))
            if group is not None:
                expected.setdefault(i, set()).add(group)
    extra = [(ast.unparse(s.node)[:80], sorted(s.writes - expected.get(i, set()) - {WORLD, RNG}))
             for i, s in enumerate(golden.program.statements)
             if s.kind == "launch" and not is_alignment_copy(s)]  # (its write orders readers after the copy)
    assert not [e for e in extra if e[1]], [e for e in extra if e[1]][:5]

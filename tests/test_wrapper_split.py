"""The weight-gradient split made in the program put on streams only (concur.inductor.wrapper_split), on real
backward wrappers of inductor: the H100's (torch 2.11) and 2.15's CUDA code generation."""

from __future__ import annotations

import ast
import gzip
import re
from pathlib import Path

import pytest

from concur.inductor.backward_split import SplitCall
from concur.inductor.wrapper_parse import parse_wrapper_source
from concur.inductor.wrapper_split import split_costs, split_weight_gradient_calls

FIXTURES = Path(__file__).parent / "fixtures" / "wrappers"
BACKWARDS = ["torch2.11.0-cuda/googlenet_bf16_cl_bwd", "torch2.15.0-cuda-codegen/branchy_bf16_cl_bwd"]
JOINT = re.compile(r"^\s*(\w+) = torch\.ops\.aten\.convolution_backward\.default\(.*\[True, True, (True|False)\]\)$",
                   re.M)


def _source(name: str) -> str:
    return gzip.decompress((FIXTURES / name / "wrapper.py.gz").read_bytes()).decode()


def _joint_sources(source: str) -> dict[str, tuple[bool, ...]]:
    """The joint calls' source names (the convolution_backward listed above each) and masks."""
    found = {}
    lines = source.splitlines()
    for i, line in enumerate(lines):
        m = JOINT.match(line)
        if m:
            nodes = re.search(r"Source Nodes: \[([^\]]*)\]", lines[i - 1]).group(1)
            (listed,) = re.findall(r"\bconvolution_backward(?:_\d+)?\b", nodes)
            found[listed] = (True, True, m.group(2) == "True")
    return found


def _calls(joints: dict[str, tuple[bool, ...]], copied: frozenset[str] = frozenset()) -> dict[str, SplitCall]:
    return {name: SplitCall(name, mask, name in copied, {f"{name}.input": (1.0, {}), f"{name}.weight": (2.0, {}),
                                                         **({f"{name}.copy": (0.5, {})} if name in copied else {})})
            for name, mask in joints.items()}


@pytest.mark.parametrize("name", BACKWARDS)
def test_every_joint_call_is_split_into_its_two_parts_and_each_reads_what_the_joint_call_read(name):
    source = _source(name)
    joints = _joint_sources(source)
    assert len(joints) >= 5
    split_source, done = split_weight_gradient_calls(source, _calls(joints))
    assert sorted(s.source for s in done) == sorted(joints)
    before, after = parse_wrapper_source(source), parse_wrapper_source(split_source)
    assert not any(s.kind == "barrier" for s in after.launches)
    assert len(after.launches) == len(before.launches) + len(joints)
    assert after.inputs == before.inputs and after.outputs == before.outputs
    by_origin = {s.origins: s for s in after.launches}
    for joint in joints:
        input_part, weight_part = by_origin[(f"{joint}.input",)], by_origin[(f"{joint}.weight",)]
        assert input_part.reads == weight_part.reads  # grad_output, input, weight: both read all three
        assert [e.value for e in input_part.node.value.args[10].elts] == [True, False, False]
        assert [e.value for e in weight_part.node.value.args[10].elts] == [False, True, joints[joint][2]]
        # the weight gradient is read from the weight part, the input gradient from the input part
        weight_name, input_name = next(iter(weight_part.binds)), next(iter(input_part.binds))
        uses = [s for s in after.statements if s.kind == "host" and (weight_name in s.uses or input_name in s.uses)]
        assert {ast_index(s) for s in uses if weight_name in s.uses} <= {1, 2}
        assert {ast_index(s) for s in uses if input_name in s.uses} == {0}
    # the joint call's name no longer names a cost; its parts do
    costs = split_costs({j: (9.0, {}) for j in joints} | {"other": (1.0, {})}, done)
    assert set(costs) == {"other"} | {f"{j}.{p}" for j in joints for p in ("input", "weight")}


def ast_index(statement) -> int:
    """The k of ``x = name[k]``."""
    return statement.node.value.slice.value


def test_a_copied_input_is_made_once_read_by_both_parts_and_deleted():
    source = _source(BACKWARDS[0])
    joints = _joint_sources(source)
    copied = sorted(joints)[0]
    split_source, done = split_weight_gradient_calls(source, _calls(joints, frozenset({copied})))
    after = parse_wrapper_source(split_source)
    (copy,) = [s for s in after.launches if s.origins == (f"{copied}.copy",)]
    assert "aten.clone.default" in split_source and "memory_format=torch.channels_last" in split_source
    name = next(iter(copy.binds))
    readers = [s for s in after.launches if name in s.uses]
    assert sorted(s.origins for s in readers) == [(f"{copied}.input",), (f"{copied}.weight",)]
    assert any(s.kind == "del" and s.uses == {name} for s in after.statements)
    assert sum(1 for s in after.launches if "clone" in ast_text(s)) == 1


def ast_text(statement) -> str:
    return ast.unparse(statement.node)


def test_calls_not_read_in_full_stay_joint():
    source = _source(BACKWARDS[0])
    joints = _joint_sources(source)
    first, second = sorted(joints)[:2]
    calls = _calls(joints)
    # a mask other than the call's, or no joint call of the graph listed above it: not this call
    calls[first] = SplitCall(first, (True, True, True), False, {})
    del calls[second]
    _, done = split_weight_gradient_calls(source, calls)
    assert {s.source for s in done} == set(joints) - {first, second}
    # the joint result used whole (not only through [k] and del): left joint
    (line,) = [m for m in JOINT.finditer(source)
               if re.search(rf"\b{sorted(joints)[2]}\]", source[:m.start()].splitlines()[-1])]
    result = line.group(1)
    used_whole = source.replace(f"    del {result}\n", f"    print({result})\n", 1)
    assert used_whole != source
    _, done = split_weight_gradient_calls(used_whole, _calls(joints))
    assert sorted(joints)[2] not in {s.source for s in done} and len(done) == len(joints) - 1
    # a name the split would bind already taken: left joint
    taken = source + f"\n{result}_weight_grad = None\n"
    _, done = split_weight_gradient_calls(taken, _calls(joints))
    assert sorted(joints)[2] not in {s.source for s in done}


def test_nothing_to_split_leaves_the_source_as_it_is():
    source = _source(BACKWARDS[0])
    assert split_weight_gradient_calls(source, {}) == (source, ())

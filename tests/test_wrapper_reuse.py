"""Tests for inductor's buffer reuse kept only where the streams order it (``buffer_reuse="ordered"``).

``buf2 = buf0; del buf0  # reuse`` puts branch B's buffer in branch A's dead
memory. Read as one storage, that line orders B's first kernel after every
kernel of A and chains the branches. With ``split_reuses`` the parse
(:mod:`concur.inductor.wrapper_parse`) gives buf2 a group of its own when
the kernel writing it first only stores to it, and the plan
(:mod:`concur.inductor.wrapper_emit`) keeps the reuse where its schedule
orders A before B anyway, else allocates buf2 afresh: like buf0, or, when
no allocator call made buf0 (an input, a kernel's result), with the size
and stride the wrapper asserts and the dtype buf2's first kernel declares.
The hand-written wrapper below is that two-branch graph, with a third
independent launch first so that branch A's stream is not the caller's.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import gzip
import re
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.nn as nn

import schedulers
from concur.dag.cost import Roofline
from concur.dag.decide import schedule_graph
from concur.inductor.placement import place_kernels
from concur.inductor.wrapper_build import build_call
from concur.inductor.wrapper_emit import kept_reuses, launch_dag, plan_emission
from concur.inductor.kernel_signatures import (_cpp_pointer_dtype, _cpp_stores_only, _triton_pointer_dtype,
                                               _triton_signature, kernel_signatures)
from concur.inductor.wrapper_parse import parse_wrapper, parse_wrapper_source, source_namespace

COPY = '''
@triton_heuristics.pointwise(
    triton_meta={'signature': {'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}},
)
@triton.jit
def triton_poi_copy(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    tmp0 = tl.load(in_ptr0 + (xindex), xmask)
    tl.store(out_ptr0 + (xindex), tmp0, xmask)
'''

ADD_INPLACE = '''
@triton_heuristics.pointwise(
    triton_meta={'signature': {'in_out_ptr0': '*fp32', 'in_ptr0': '*fp32', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}},
)
@triton.jit
def triton_poi_add(in_out_ptr0, in_ptr0, xnumel, XBLOCK : tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    tmp0 = tl.load(in_out_ptr0 + (xindex), xmask)
    tmp1 = tl.load(in_ptr0 + (xindex), xmask)
    tl.store(in_out_ptr0 + (xindex), tmp0 + tmp1, xmask)
'''

WRAPPER = f"""
import torch
triton_poi_copy = async_compile.triton('triton_poi_copy', '''{COPY}''', device_str='cuda')
triton_poi_add = async_compile.triton('triton_poi_add', '''{ADD_INPLACE}''', device_str='cuda')

def call(args):
    primals_1, primals_2, primals_3 = args
    args.clear()
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf9 = empty_strided_cuda((8, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [c], Original ATen: [aten.clone]
        stream0 = get_raw_stream(0)
        triton_poi_copy.run(primals_3, buf9, 8, stream=stream0)
        buf0 = empty_strided_cuda((8, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [a0], Original ATen: [aten.clone]
        stream0 = get_raw_stream(0)
        triton_poi_copy.run(primals_1, buf0, 8, stream=stream0)
        buf1 = empty_strided_cuda((8, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [a1], Original ATen: [aten.clone]
        stream0 = get_raw_stream(0)
        triton_poi_copy.run(buf0, buf1, 8, stream=stream0)
        buf2 = buf0; del buf0  # reuse
        # Topologically Sorted Source Nodes: [b0], Original ATen: [aten.clone]
        stream0 = get_raw_stream(0)
        triton_poi_copy.run(primals_2, buf2, 8, stream=stream0)
        buf3 = empty_strided_cuda((8, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [b1], Original ATen: [aten.clone]
        stream0 = get_raw_stream(0)
        triton_poi_copy.run(buf2, buf3, 8, stream=stream0)
        del buf2
    return (buf1, buf3, buf9, )
"""

B0 = "triton_poi_copy.run(primals_2, buf2"


def parse(source: str = WRAPPER, split: bool = True):
    return parse_wrapper(source, {"torch": torch}, split_reuses=split)


def launch(program, text: str | tuple[str, ...]) -> int:
    (s,) = [s for s in program.launches if ast.unparse(s.node).startswith(text)]
    return s.index


def launches(program) -> dict[str, int]:
    return {name: launch(program, text) for name, text in [
        ("c", "triton_poi_copy.run(primals_3"),
        ("a0", ("triton_poi_copy.run(primals_1", "buf0 = torch.ops.aten", "buf5 = torch.ops.aten")),
        ("a1", "triton_poi_copy.run(buf0"), ("b0", B0), ("b1", "triton_poi_copy.run(buf2")]}


def schedule(program, dag, streams: dict[str, int], order=("c", "a0", "a1", "b0", "b1"), orders=()):
    """The launches in ``order`` on the given streams; ``orders`` adds waits the DAG does not need."""
    at = launches(program)
    need = dag.copy()
    need.add_edges_from((at[u], at[v]) for u, v in orders)
    result = schedulers.build_schedule(need, [at[n] for n in order], {at[n]: s for n, s in streams.items()}, "test")
    assert not schedulers.validate(dag, result)
    return result


def codes(plan) -> list[str]:
    return [ast.unparse(s.statement.node) for s in plan.steps if s.op == "stmt"]


def protects(plan) -> dict[str, tuple[int, ...]]:
    return {s.name: s.streams for s in plan.steps if s.op == "protect"}


# ---------------------------------------------------------------- the parse


def test_a_reuse_by_a_kernel_that_only_stores_gets_its_own_group_and_no_edge():
    inductor, split = parse(split=False), parse()
    at = launches(split)
    chained = launch_dag(inductor, {}, 1.0)
    assert nx.has_path(chained, at["a1"], at["b0"])  # read as one storage: B waits for A
    dag = launch_dag(split, {}, 1.0)
    assert not any(nx.has_path(dag, u, v) or nx.has_path(dag, v, u)
                   for u in (at["a0"], at["a1"]) for v in (at["b0"], at["b1"]))
    (reuse,) = split.reuses
    assert split.reuse_lines == inductor.reuse_lines == 1 and inductor.reuses == ()
    assert reuse.first_access == at["b0"] and reuse.old_group != reuse.new_group
    assert ast.unparse(reuse.fresh.node) == "buf2 = empty_strided_cuda((8,), (1,), torch.float32)"
    assert reuse.fresh.fresh == {reuse.new_group}


def test_an_in_place_reuse_keeps_its_alias_and_its_edge():
    source = WRAPPER.replace(B0, "triton_poi_add.run(buf2, primals_2")
    program = parse(source)
    assert program.reuses == () and program.reuse_lines == 1
    dag = launch_dag(program, {}, 1.0)
    assert nx.has_path(dag, launch(program, "triton_poi_copy.run(buf0"), launch(program, "triton_poi_add.run(buf2"))


@pytest.mark.parametrize("change", [
    # an earlier view of buf0 read after the reuse line: buf0's memory is not dead
    ("buf2 = buf0; del buf0  # reuse", "buf4 = reinterpret_tensor(buf0, (8, ), (1, ), 0)\n"
     "        buf2 = buf0; del buf0  # reuse\n        extern_kernels.mm(buf4, primals_1, out=buf9)"),
    # the old buffer is an input, and no assertion states its layout: there is no allocation to repeat
    ("buf2 = buf0; del buf0  # reuse", "buf2 = primals_1; del primals_1  # reuse"),
    # the old buffer was made by a kernel, not by an allocator, and no assertion states its layout
    ("buf0 = empty_strided_cuda((8, ), (1, ), torch.float32)", "buf0 = extern_kernels.mm(primals_1, primals_3)"),
    # the first kernel writing the new buffer also reads it through another argument
    (B0, "triton_poi_copy.run(buf2, buf2"),
])
def test_a_reuse_that_cannot_be_proven_renameable_keeps_its_alias(change):
    program = parse(WRAPPER.replace(*change))
    assert program.reuses == () and program.reuse_lines == 1


def test_a_reinterpreted_reuse_reinterprets_a_fresh_allocation():
    program = parse(WRAPPER.replace("buf2 = buf0; del buf0  # reuse",
                                    "buf2 = reinterpret_tensor(buf0, (2, 4), (4, 1), 0); del buf0  # reuse"))
    (reuse,) = program.reuses
    assert ast.unparse(reuse.fresh.node) == \
        "buf2 = reinterpret_tensor(empty_strided_cuda((8,), (1,), torch.float32), (2, 4), (4, 1), 0)"


# ---------------------------------------------------------------- reuses of memory no allocator call made

A0 = """        buf0 = empty_strided_cuda((8, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [a0], Original ATen: [aten.clone]
        stream0 = get_raw_stream(0)
        triton_poi_copy.run(primals_1, buf0, 8, stream=stream0)
"""
# branch A's first buffer is an aten kernel's result, its layout stated by the assertion inductor writes after it
KERNEL_RESULT = WRAPPER.replace(A0, """        # Topologically Sorted Source Nodes: [a0], Original ATen: [aten.cumsum]
        buf0 = torch.ops.aten.cumsum.default(primals_1, 0)
        assert_size_stride(buf0, (8, ), (1, ), 'torch.ops.aten.cumsum.default')
""")
# ... or the first item of a tuple an aten kernel returns
TUPLE_ITEM = WRAPPER.replace(A0, """        # Topologically Sorted Source Nodes: [a0], Original ATen: [aten.sort]
        buf5 = torch.ops.aten.sort.default(primals_1)
        buf0 = buf5[0]
        assert_size_stride(buf0, (8, ), (1, ), 'torch.ops.aten.sort.default')
        del buf5
""")
# branch B's buffer reuses an input, whose layout inductor asserts at the top of call
INPUT = WRAPPER.replace("args.clear()", "args.clear()\n    assert_size_stride(primals_1, (8, ), (1, ), 'input')") \
    .replace("buf2 = buf0; del buf0  # reuse", "buf2 = primals_1; del primals_1  # reuse")
FRESH_FP32 = "buf2 = empty_strided_cuda((8,), (1,), torch.float32)"


@pytest.mark.parametrize("source", [KERNEL_RESULT, TUPLE_ITEM, INPUT], ids=["kernel-result", "tuple-item", "input"])
def test_a_reuse_of_memory_no_allocator_made_is_allocated_as_the_wrapper_states_it(source):
    """Size and stride from the assertion, dtype from the first kernel's signature, device from the wrapper."""
    inductor, split = parse(source, split=False), parse(source)
    (reuse,) = split.reuses
    assert inductor.reuses == () and split.reuse_lines == 1
    assert reuse.made_from == "stated" and ast.unparse(reuse.fresh.node) == FRESH_FP32
    at = launches(split)
    assert reuse.first_access == at["b0"]
    dag = launch_dag(split, {}, 1.0)
    assert not any(nx.has_path(dag, u, at["b0"]) for u in (at["a0"], at["a1"]))


def test_the_stated_dtype_is_the_one_the_kernels_declare():
    (reuse,) = parse(KERNEL_RESULT.replace("*fp32", "*bf16")).reuses
    assert ast.unparse(reuse.fresh.node) == "buf2 = empty_strided_cuda((8,), (1,), torch.bfloat16)"


def test_a_reinterpreted_reuse_of_a_kernel_result_gets_the_views_own_layout():
    view = "buf2 = reinterpret_tensor(buf0, (2, 4), (4, 1), 0); del buf0  # reuse"
    (reuse,) = parse(KERNEL_RESULT.replace("buf2 = buf0; del buf0  # reuse", view)).reuses
    assert ast.unparse(reuse.fresh.node) == "buf2 = empty_strided_cuda((2, 4), (4, 1), torch.float32)"


FROM_BF16 = COPY.replace("triton_poi_copy", "triton_poi_from_bf16").replace("'in_ptr0': '*fp32'", "'in_ptr0': '*bf16'")
# KERNEL_RESULT with a kernel that reads bf16, for a launch to declare another type than the others
WITH_FROM_BF16 = KERNEL_RESULT.replace("triton_poi_add = ", "triton_poi_from_bf16 = async_compile.triton("
                                       f"'triton_poi_from_bf16', \'\'\'{FROM_BF16}\'\'\', device_str='cuda')\n"
                                       "triton_poi_add = ")


@pytest.mark.parametrize("change", [
    # the kernels declare a type no one torch dtype is spelled as (u8 is also how float8_e8m0fnu is passed)
    ("*fp32", "*u8"),
    # the kernel writing buf2 declares fp32 and the one reading it bf16: one of them is not what it seems
    ("triton_poi_copy.run(buf2, buf3", "triton_poi_from_bf16.run(buf2, buf3"),
    # a view at an offset: not a buffer of its own
    ("buf2 = buf0; del buf0  # reuse", "buf2 = reinterpret_tensor(buf0, (4, ), (1, ), 4); del buf0  # reuse"),
    # two statements of buf0's layout that differ
    ("del buf0  # reuse", "del buf0  # reuse\n        assert_size_stride(buf2, (2, 4), (4, 1))"),
    # an op that may restride buf0 after its layout was asserted
    ("'torch.ops.aten.cumsum.default')", "'torch.ops.aten.cumsum.default')\n"
                                         "        torch.ops.aten.resize_.default(buf0, [8])"),
    # a size that is a symbol
    ("assert_size_stride(buf0, (8, ), (1, )", "assert_size_stride(buf0, (s0, ), (1, )"),
    # no assertion states buf0's layout
    ("assert_size_stride(buf0, (8, ), (1, ), 'torch.ops.aten.cumsum.default')", ""),
    # the first writer is given a view of buf2, not buf2: its pointer's type is the view's
    (B0, "triton_poi_copy.run(primals_2, reinterpret_tensor(buf2, (8, ), (1, ), 0)"),
    # the first writer declares no element type (an extern kernel's out=)
    (B0 + ", 8, stream=stream0)", "extern_kernels.mm(primals_2, primals_3, out=buf2)"),
    # a kernel compiled for a device whose allocator the wrapper never calls
    ("device_str='cuda'", "device_str='xpu'"),
], ids=["unknown-dtype", "dtypes-disagree", "nonzero-offset", "layouts-disagree", "restrided", "symbolic-size",
        "no-assertion", "written-through-a-view", "untyped-first-writer", "other-device"])
def test_a_reuse_whose_stated_storage_is_not_proven_keeps_its_alias(change):
    assert len(parse(WITH_FROM_BF16).reuses) == 1
    source = WITH_FROM_BF16.replace(*change)
    assert source != WITH_FROM_BF16
    program = parse(source)
    assert program.reuses == () and program.reuse_lines == 1


@pytest.mark.parametrize("dtype, renamed", [("torch.float32", True), ("torch.bfloat16", False)])
def test_a_reuse_of_a_view_is_renamed_only_where_the_viewed_allocation_has_the_declared_type(dtype, renamed):
    """buf0 views an allocation (not a whole one: no call to repeat); its allocator states a dtype too."""
    source = KERNEL_RESULT.replace("buf0 = torch.ops.aten.cumsum.default(primals_1, 0)",
                                   f"buf7 = empty_strided_cuda((8, ), (1, ), {dtype})\n"
                                   "        buf0 = reinterpret_tensor(buf7, (8, ), (1, ), 0); del buf7\n"
                                   "        triton_poi_copy.run(primals_1, buf0, 8, stream=stream0)")
    assert len(parse(source).reuses) == renamed


def test_pointer_types_map_to_one_dtype_each_or_none():
    assert _triton_pointer_dtype("*bf16") == torch.bfloat16 and _triton_pointer_dtype("*i1") == torch.bool
    assert _triton_pointer_dtype("*u8") is None and _triton_pointer_dtype("fp32") is None  # ambiguous; a scalar
    assert _cpp_pointer_dtype("const at::BFloat16*") == _cpp_pointer_dtype("at::BFloat16*") == torch.bfloat16
    assert _cpp_pointer_dtype("float* __restrict__") == torch.float32
    assert _cpp_pointer_dtype("uint8_t*") is None and _cpp_pointer_dtype("float**") is None
    assert _cpp_pointer_dtype("float") is None


def test_triton_pointer_types_are_read_only_where_launches_map_one_to_one():
    source = COPY.replace("'XBLOCK': 'constexpr'", "'XBLOCK': 'constexpr', 'ks0': 'i32'") \
        .replace("XBLOCK : tl.constexpr):", "XBLOCK : tl.constexpr, ks0):")
    assert _triton_signature(COPY).dtypes == {"in_ptr0": torch.float32, "out_ptr0": torch.float32}
    assert _triton_signature(source).dtypes == {}  # ks0 after a constexpr the launch does not pass


CPP_COPY = '''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const {ctype}* in_ptr0,
                       {ctype}* out_ptr0)
{{
    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(8L); x0+=static_cast<int64_t>(1L))
    {{
        auto tmp0 = in_ptr0[static_cast<int64_t>(x0)];
        out_ptr0[static_cast<int64_t>(x0)] = tmp0;
    }}
}}
'''

CPU_WRAPPER = """
import torch
cpp_fused_copy_0 = async_compile.cpp_pybinding(['const {ctype}*', '{ctype}*'], \'\'\'{kernel}\'\'\')

def call(args):
    primals_1, primals_2, primals_3 = args
    args.clear()
    assert_size_stride(primals_1, (8, ), (1, ), 'input')
    buf9 = empty_strided_cpu((8, ), (1, ), {dtype})
    cpp_fused_copy_0(primals_3, buf9)
    buf0 = torch.ops.aten.cumsum.default(primals_1, 0)
    assert_size_stride(buf0, (8, ), (1, ), 'torch.ops.aten.cumsum.default')
    buf1 = empty_strided_cpu((8, ), (1, ), {dtype})
    cpp_fused_copy_0(buf0, buf1)
    buf2 = buf0; del buf0  # reuse
    cpp_fused_copy_0(primals_2, buf2)
    buf3 = empty_strided_cpu((8, ), (1, ), {dtype})
    cpp_fused_copy_0(buf2, buf3)
    del buf2
    return (buf1, buf3, buf9, )
"""


def cpu_wrapper(ctype: str, dtype: str) -> str:
    return CPU_WRAPPER.format(ctype=ctype, kernel=CPP_COPY.format(ctype=ctype), dtype=dtype)


@pytest.mark.parametrize("ctype, dtype", [("float", "torch.float32"), ("at::BFloat16", "torch.bfloat16")])
def test_a_cpu_reuse_of_a_kernel_result_takes_the_cpp_type_and_allocator(ctype, dtype):
    (reuse,) = parse(cpu_wrapper(ctype, dtype)).reuses
    assert ast.unparse(reuse.fresh.node) == f"buf2 = empty_strided_cpu((8,), (1,), {dtype})"


def test_a_cpu_reuse_of_an_unknown_cpp_type_keeps_its_alias():
    assert parse(cpu_wrapper("uint8_t", "torch.uint8")).reuses == ()


def test_a_rewritten_cpu_call_runs_with_a_stated_allocation():
    """The C++ wrapper above, its reuse of a cumsum's result made fresh, run on the CPU (the kernel a Python copy)."""
    program = parse(cpu_wrapper("at::BFloat16", "torch.bfloat16"))
    dag = launch_dag(program, {}, 1.0)
    order = [s.index for s in program.launches]  # c, a0 (cumsum), a1, b0, b1
    streams = dict(zip(order, [0, 1, 1, 0, 0]))
    plan = plan_emission(program, schedulers.build_schedule(dag, order, streams, "test"), dag)
    assert (plan.reuses_kept, plan.reuses_fresh) == (0, 1)
    assert "buf2 = empty_strided_cpu((8,), (1,), torch.bfloat16)" in codes(plan)
    namespace = {"torch": torch, "empty_strided_cpu": torch._C._dynamo.guards._empty_strided_cpu,
                 "assert_size_stride": torch._C._dynamo.guards.assert_size_stride,
                 "cpp_fused_copy_0": lambda source, target: target.copy_(source)}
    call, _ = build_call(program, plan, namespace)
    a, b, c = (torch.randn(8, dtype=torch.bfloat16) for _ in range(3))
    out_a, out_b, out_c = call([a, b, c])
    assert torch.equal(out_a, torch.cumsum(a, 0)) and torch.equal(out_b, b) and torch.equal(out_c, c)
    assert out_b.dtype == torch.bfloat16


def test_an_extern_kernel_overwrites_only_its_out():
    mm = "extern_kernels.mm(primals_2, primals_3, out=buf2)"
    assert len(parse(WRAPPER.replace(B0 + ", 8, stream=stream0)", mm)).reuses) == 1
    addmm = "extern_kernels.addmm(buf2, primals_2, primals_3, alpha=1, beta=1, out=buf2)"  # reads what it scales
    assert parse(WRAPPER.replace(B0 + ", 8, stream=stream0)", addmm)).reuses == ()


def stores_only(body: str, params: str = "in_ptr0, out_ptr0", mutated: str = "") -> set[str]:
    src = (f"@triton_heuristics.pointwise(inductor_meta={{'mutated_arg_names': [{mutated}]}})\n@triton.jit\n"
           f"def k({params}, xnumel, XBLOCK : tl.constexpr):\n"
           + "\n".join("    " + line for line in body.strip().splitlines()))
    return set(_triton_signature(src).stores_only)


def test_triton_pointers_only_stored_to():
    assert stores_only("tl.store(out_ptr0 + (xindex), tl.load(in_ptr0 + xindex), xmask)") == {"out_ptr0"}
    assert stores_only("p = out_ptr0 + xindex\ntl.store(p, 1.0)") == {"out_ptr0"}
    assert stores_only("tl.store(out_ptr0 + x, 1.0)\ny = tl.load(out_ptr0 + x)") == set()  # read back
    assert stores_only("tl.atomic_add(out_ptr0 + x, 1.0)") == set()  # an atomic reads the old value
    assert stores_only("tl.store(out_ptr0 + x, 1.0)", mutated="'out_ptr0'") == set()  # updates what is there
    assert stores_only("tl.store(in_out_ptr0 + x, 1.0)", params="in_out_ptr0") == set()
    assert stores_only("pass") == set()  # never used: nothing proven


CPP = '''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(float* in_out_ptr0,
                       const float* in_ptr1,
                       float* out_ptr0,
                       float* out_ptr1,
                       float* out_ptr2,
                       float* out_ptr3)
{
    auto in_ptr0 = in_out_ptr0;
    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(8L); x0+=static_cast<int64_t>(16L))
    {
        auto tmp0 = at::vec::Vectorized<float>::loadu(in_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(8L));
        tmp0.store(out_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(8L));
        tmp0.store(out_ptr1 + static_cast<int64_t>(x0));
        out_ptr2[static_cast<int64_t>(x0)] = in_ptr1[static_cast<int64_t>(x0)];
        out_ptr3[static_cast<int64_t>(x0)] += in_ptr1[static_cast<int64_t>(x0)];
        tmp0.store(in_out_ptr0 + static_cast<int64_t>(x0));
    }
    {
        auto tmp1 = at::vec::Vectorized<float>::loadu(out_ptr1 + static_cast<int64_t>(0L), static_cast<int64_t>(8L));
    }
}
'''


def test_cpp_pointers_only_stored_to():
    # out_ptr0 and out_ptr2 are only stored to; out_ptr1 is read back, out_ptr3 accumulated into,
    # in_out_ptr0 read through a local
    assert _cpp_stores_only(CPP, 6) == {2, 4}
    assert _cpp_stores_only(CPP, 5) == set()  # the declaration does not match the types: nothing proven
    types = "['float*', 'const float*', 'float*', 'float*', 'float*', 'float*']"
    sig = kernel_signatures(f"k = async_compile.cpp_pybinding({types}, '''{CPP}''')\n")["k"]
    assert sig.stores_only == {"arg2", "arg4"}


# ---------------------------------------------------------------- the plan


def test_branches_on_two_streams_get_a_fresh_allocation():
    program = parse()
    dag = launch_dag(program, {}, 1.0)
    plan = plan_emission(program, schedule(program, dag, {"c": 0, "a0": 1, "a1": 1, "b0": 0, "b1": 0}), dag)
    assert plan.num_streams == 2 and plan.num_waits == 0  # nothing orders the branches
    assert (plan.reuses_kept, plan.reuses_fresh) == (0, 1)
    emitted = codes(plan)
    assert "buf2 = buf0" not in emitted
    fresh = emitted.index("buf2 = empty_strided_cuda((8,), (1,), torch.float32)")
    assert fresh < emitted.index(B0 + ", 8, stream=stream0)")
    assert "buf2" not in protects(plan) and "buf0" not in protects(plan)  # each used on its own stream only


def test_one_stream_keeps_the_reuse_as_inductor_wrote_it():
    program = parse()
    dag = launch_dag(program, {}, 1.0)
    plan = plan_emission(program, schedule(program, dag, dict.fromkeys(["c", "a0", "a1", "b0", "b1"], 0)), dag)
    assert (plan.reuses_kept, plan.reuses_fresh) == (1, 0)
    assert "buf2 = buf0" in codes(plan) and "del buf0" in codes(plan)


def test_one_stream_in_another_order_makes_it_fresh():
    """On one stream too, a B kernel issued before A's last one would write A's memory under it."""
    program = parse()
    dag = launch_dag(program, {}, 1.0)
    plan = plan_emission(program, schedule(program, dag, dict.fromkeys(["c", "a0", "a1", "b0", "b1"], 0),
                                           order=("c", "a0", "b0", "a1", "b1")), dag)
    assert (plan.reuses_kept, plan.reuses_fresh) == (0, 1)


def test_an_event_that_orders_the_branches_keeps_the_reuse_and_protects_the_shared_memory():
    program = parse()
    dag = launch_dag(program, {}, 1.0)
    plan = plan_emission(program, schedule(program, dag, {"c": 0, "a0": 1, "a1": 1, "b0": 0, "b1": 0},
                                           orders=[("a1", "b0")]), dag)
    assert (plan.reuses_kept, plan.reuses_fresh) == (1, 0) and plan.num_waits == 1
    assert "buf2 = buf0" in codes(plan)
    # buf0's memory was allocated on stream 1 (branch A); through buf2, branch B used it on stream 0
    assert protects(plan)["buf2"] == (0,)


def test_a_kept_reuse_the_steps_do_not_order_is_refused(monkeypatch):
    import concur.inductor.wrapper_emit as emit

    program = parse()
    dag = launch_dag(program, {}, 1.0)
    unordered = schedule(program, dag, {"c": 0, "a0": 1, "a1": 1, "b0": 0, "b1": 0})
    monkeypatch.setattr(emit, "kept_reuses", lambda program, schedule: frozenset(r.statement for r in program.reuses))
    with pytest.raises(ValueError, match="keeps a buffer reuse its streams do not order"):
        plan_emission(program, unordered, dag)


def test_the_rewritten_call_runs_with_the_fresh_allocation():
    program = parse()
    dag = launch_dag(program, {}, 1.0)
    plan = plan_emission(program, schedule(program, dag, {"c": 0, "a0": 1, "a1": 1, "b0": 0, "b1": 0}), dag)
    assert plan.reuses_fresh == 1

    class Copy:
        @staticmethod
        def run(source, target, n, stream=None):
            target.copy_(source)

    fake_cuda = type("Cuda", (), {"_DeviceGuard": staticmethod(lambda i: contextlib.nullcontext()),
                                  "set_device": staticmethod(lambda i: None)})
    namespace = {"torch": type("T", (), {"cuda": fake_cuda, "float32": torch.float32}),
                 "get_raw_stream": lambda i: 0, "triton_poi_copy": Copy, "triton_poi_add": Copy,
                 "empty_strided_cuda": lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype)}
    call, _ = build_call(program, plan, namespace)
    a, b, c = torch.randn(8), torch.randn(8), torch.randn(8)
    out_a, out_b, out_c = call([a, b, c])
    assert torch.equal(out_a, a) and torch.equal(out_b, b) and torch.equal(out_c, c)


def test_place_kernels_counts_what_runs(monkeypatch):
    """Installed, the plan's own counts; left on one stream by the gate, inductor's call keeps every reuse."""
    from concur import _torch_compat as compat

    installed: list = []
    monkeypatch.setattr(compat, "inductor_wrapper", lambda compiled: (WRAPPER, {"torch": torch}, None,
                                                                      installed.append))
    roof = Roofline("test", flops_per_us=1e3, bytes_per_us=1e2, kernel_overhead_us=0.0)
    costs = {name: (10.0, {}) for name in ("c", "a0", "a1", "b0", "b1")}
    placed = place_kernels(object(), costs, roof, 4, "critical_path", split_reuses=True)
    assert placed.installed and placed.plan.num_streams > 1
    assert (placed.reuses_kept, placed.reuses_fresh) == (0, 1)
    gated = place_kernels(object(), costs, roof, 4, "critical_path", min_predicted_speedup=100.0, split_reuses=True)
    assert not gated.installed and (gated.reuses_kept, gated.reuses_fresh) == (1, 0)
    chained = place_kernels(object(), costs, roof, 4, "critical_path")  # the reuse read as inductor's one storage
    assert (chained.reuses_kept, chained.reuses_fresh) == (1, 0)


# ---------------------------------------------------------------- a real wrapper


WRAPPERS = Path(__file__).parent / "fixtures" / "wrappers"
GOLDEN = WRAPPERS / "torch2.11.0-cuda" / "googlenet_fp32_bwd"
GOLDEN_BF16 = WRAPPERS / "torch2.11.0-cuda" / "googlenet_bf16_cl_bwd"


@pytest.mark.parametrize("path", [GOLDEN, GOLDEN_BF16, WRAPPERS / "torch2.14.1-cpu" / "googlenet_fp32_bwd"],
                         ids=["cuda-2.11-googlenet-bwd", "cuda-2.11-googlenet-bf16-bwd", "cpu-2.14.1-googlenet-bwd"])
def test_real_wrappers_split_no_reuse_their_first_kernel_reads(path):
    """Inductor's scheduler (the oracle) must not list the old or the new buffer among the first kernel's reads.

    Such a read would make the reuse an in-place update, whose alias must
    stay; triton kernels (CUDA) and C++ kernel groups (CPU) are each read
    their own way. Every split reuse of every checked-in wrapper passes this
    check; two are run here to stay fast.
    """
    from tests.test_golden_wrappers import load

    golden = load(path)
    split = parse_wrapper(golden.source, source_namespace(golden.source), split_reuses=True)
    assert 0 < len(split.reuses) < split.reuse_lines == golden.program.reuse_lines
    position = {s.index: k for k, s in enumerate(split.statements)}
    index = {s.index: s for s in split.statements}
    for reuse in split.reuses:
        (new,) = index[reuse.statement].binds
        (old,) = index[reuse.statement].uses - {"reinterpret_tensor"}
        nodes = [n for n in golden.nodes if golden.launch_of.get(n["name"]) == position[reuse.first_access]]
        assert nodes, ast.unparse(index[reuse.first_access].node)[:80]
        for node in nodes:
            reads = {golden.real_name.get(r, r) for r in node["reads"]}
            assert not reads & {old, new}, (node["name"], ast.unparse(index[reuse.statement].node))


def test_a_real_wrapper_keeps_every_reuse_on_one_stream_and_some_on_four():
    """GoogLeNet's backward on the H100 (torch 2.11), costed one unit per launch.

    On one stream in program order every reuse is kept, as inductor wrote
    them; a 4-stream schedule of the split DAG keeps some, makes the rest
    fresh, and is shorter than the schedule of the DAG the reuses chain.
    """
    source = gzip.open(GOLDEN / "wrapper.py.gz", "rt").read()
    chained, split = parse_wrapper_source(source), parse_wrapper(source, source_namespace(source), split_reuses=True)
    dag = launch_dag(split, {}, 1.0)
    order = [s.index for s in split.launches]
    one = plan_emission(split, schedulers.build_schedule(dag, order, dict.fromkeys(order, 0), "program"), dag)
    assert (one.reuses_kept, one.reuses_fresh) == (split.reuse_lines, 0)
    four = schedule_graph(dag, 4, "critical_path", 0.0)
    plan = plan_emission(split, four, dag)
    assert plan.num_streams == 4 and plan.reuses_fresh > 0
    assert plan.reuses_kept > split.reuse_lines - len(split.reuses)  # some split reuses are ordered anyway
    assert plan.reuses_kept + plan.reuses_fresh == split.reuse_lines
    assert len(kept_reuses(split, four)) == len(split.reuses) - plan.reuses_fresh
    assert four.makespan < schedule_graph(launch_dag(chained, {}, 1.0), 4, "critical_path", 0.0).makespan


# the tensor inductor's fx graph says a kernel stores (``%where_6 : Tensor "bf16[8, 128, 7, 7][6272, 1, 896, 128]``
# ``cuda:0"`` above the kernel, named by ``return %where_6``) or says a buffer is (``= PlaceHolder[target=buf50]``)
_FX_TENSOR = re.compile(r'^#\s+%(\w+) : Tensor "(\w+)\[([^\]]*)\]\[([^\]]*)\]')
_FX_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def fx_tensors(source: str) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Return ({kernel: the one tensor it stores}, {buffer: its tensor}) from the comments above the kernels."""
    stored, buffers, tensors, returned = {}, {}, {}, []
    for line in source.splitlines():
        match = _FX_TENSOR.match(line)
        if match:
            name, dtype, size, stride = match.groups()
            tensors[name] = (_FX_DTYPES.get(dtype), ast.literal_eval(f"({size},)" if size else "()"),
                             ast.literal_eval(f"({stride},)" if stride else "()"))
            if f"PlaceHolder[target={name}]" in line and name.startswith("buf"):
                buffers[name] = tensors[name]
        elif line.startswith("#   return %"):
            returned = [r.strip().lstrip("%") for r in line[len("#   return "):].split(",")]
        elif " = async_compile." in line:
            if len(returned) == 1 and returned[0] in tensors:
                stored[line.split(" = ")[0]] = tensors[returned[0]]
            tensors, returned = {}, []
    return stored, buffers


def test_a_real_wrapper_renames_reuses_of_memory_no_allocator_made_as_inductor_declares_it():
    """GoogLeNet's bf16 channels-last backward (torch 2.11, H100): 19 of its 180 reuses are renamed besides the 96
    whose old buffer an allocator call made.

    Their old memory is a graph input's (10) or a view of an allocation (9),
    reached through aliases, so there was no allocator call to repeat. Each
    fresh allocation's size, stride and dtype must be those inductor's fx
    graph gives the tensor (checked where the comments name it: all but
    one), and the plans still replay against their schedules.
    """
    source = gzip.open(GOLDEN_BF16 / "wrapper.py.gz", "rt").read()
    split = parse_wrapper(source, source_namespace(source), split_reuses=True)
    made = collections.Counter(r.made_from for r in split.reuses)
    assert split.reuse_lines == 180 and made == {"allocation": 96, "stated": 19}
    stored, buffers = fx_tensors(source)
    index = {s.index: s for s in split.statements}
    checked = 0
    for reuse in (r for r in split.reuses if r.made_from == "stated"):
        fresh = reuse.fresh.node
        (name,) = index[reuse.statement].binds
        kernel = ast.unparse(index[reuse.first_access].node.value.func).removesuffix(".run")
        expected = buffers.get(name) or stored.get(kernel)
        if expected is not None:
            size, stride, dtype = fresh.value.args
            assert (getattr(torch, dtype.attr), ast.literal_eval(size), ast.literal_eval(stride)) == expected, \
                ast.unparse(fresh)
            checked += 1
    assert checked == made["stated"] - 1
    dag = launch_dag(split, {}, 1.0)
    order = [s.index for s in split.launches]
    one = plan_emission(split, schedulers.build_schedule(dag, order, dict.fromkeys(order, 0), "program"), dag)
    assert (one.reuses_kept, one.reuses_fresh) == (split.reuse_lines, 0)
    plan = plan_emission(split, schedule_graph(dag, 4, "critical_path", 0.0), dag)
    emitted = {id(step.statement) for step in plan.steps if step.op == "stmt"}
    assert plan.num_streams == 4 and plan.reuses_kept + plan.reuses_fresh == split.reuse_lines
    assert any(id(r.fresh) in emitted for r in split.reuses if r.made_from == "stated")


# ---------------------------------------------------------------- through inductor (CPU)


class LinearBranches(nn.Module):
    """Three chains of linear layers, summed: the backward's matmuls write into ``out=`` buffers inductor reuses."""

    def __init__(self, branches: int = 3, width: int = 16, depth: int = 3):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])
            for _ in range(branches))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(sum(branch(x) for branch in self.branches))


@pytest.mark.inductor
def test_ordered_reuse_trains_like_eager_and_reports_its_reuses(monkeypatch):
    import torch._inductor.config as inductor_config

    import concur
    from tests.test_backend import NO_MERGE, compare_compiled, forward_and_backward, spy_buffer_reuse_setting

    seen = spy_buffer_reuse_setting(monkeypatch)
    torch._dynamo.reset()
    try:
        with inductor_config.patch(allow_buffer_reuse=False):  # "ordered" compiles with reuse whatever is set
            torch.manual_seed(0)
            backend = concur.backend(streams=4, roofline=NO_MERGE, buffer_reuse="ordered")
            compare_compiled(LinearBranches(), lambda: torch.randn(4, 16), backend)
    finally:
        torch._dynamo.reset()
    assert seen == [True, True]
    fw, bw = forward_and_backward(backend.graphs)
    for g in (fw, bw):
        assert g.fallback_reason is None and g.num_streams > 1 and g.num_barriers == 0, g
    # the backward's branches write their matmuls into memory inductor took from another branch
    assert bw.reuses_fresh > 0 and bw.reuses_kept + bw.reuses_fresh > bw.reuses_fresh, bw


def test_buffer_reuse_takes_true_false_or_ordered_and_defaults_to_ordered_on_both_routes():
    import concur
    from concur.inductor.stream_backend import BackendOptions

    assert BackendOptions().buffer_reuse == "ordered" and concur.backend().options.buffer_reuse == "ordered"
    assert concur.backend(buffer_reuse=False).options.buffer_reuse is False
    assert concur.backend(route="inductor_streams").options.buffer_reuse == "ordered"
    with pytest.raises(ValueError, match="buffer_reuse must be True, False or 'ordered'"):
        concur.backend(buffer_reuse="sometimes")


@pytest.mark.parametrize("setting, within_streams, expected", [
    ("ordered", True, True), ("ordered", False, False), (False, True, False), (True, False, "unchanged")])
def test_a_stamped_graph_reuses_only_where_inductor_keeps_reuse_within_a_stream(setting, within_streams, expected,
                                                                              monkeypatch):
    import types

    import torch._inductor.config as inductor_config

    import concur
    from concur import _torch_compat as compat
    from concur.inductor import stream_backend as backend_mod

    monkeypatch.setattr(compat, "inductor_reuses_within_streams_only", lambda: within_streams)
    seen = []

    def spy_compile_stamped(*args, **kwargs):
        seen.append(inductor_config.allow_buffer_reuse)
        return types.SimpleNamespace(result=None, compiled=None)

    monkeypatch.setattr(backend_mod, "compile_stamped", spy_compile_stamped)
    be = concur.backend(streams=2, buffer_reuse=setting, route="inductor_streams")
    gm = torch.fx.symbolic_trace(nn.ReLU())
    for before in (True, False):
        with inductor_config.patch(allow_buffer_reuse=before):
            be._compile_stamped(gm, [torch.randn(4)], False, 1, (), {})
            assert seen[-1] is (before if expected == "unchanged" else expected)
            assert inductor_config.allow_buffer_reuse is before


def test_inductor_reuse_counts_as_within_streams_only_when_its_key_has_the_stream(monkeypatch):
    from concur import _torch_compat as compat

    if not compat.has_inductor_node_streams():
        assert not compat.inductor_reuses_within_streams_only()
        return
    from torch._inductor.codegen import wrapper

    assert compat.inductor_reuses_within_streams_only()  # torch 2.14.1 keys reuse by (..., stream, mempool)

    def key_without_stream(node):
        return (node.get_device_or_error(), node.get_dtype())

    monkeypatch.setattr(wrapper, "buffer_reuse_key", key_without_stream)
    assert not compat.inductor_reuses_within_streams_only()

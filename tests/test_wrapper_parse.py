"""Tests for reading inductor's wrapper (concur.inductor.wrapper_parse): what each launch may write, failing closed.

What a kernel writes is established from the kernel itself: a triton
pointer counts as read-only only when its body provably just loads through
it, a C++ pointer only when it points to ``const``, an extern kernel writes
only its ``out=`` when it is one known to, and everything else counts as
written. The first test shows why names are not enough: two cooperative
reductions share the graph's semaphores as ``sem_ptr``, which no parameter
name marks as written, and must still be ordered.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest
import torch

from concur.inductor.kernel_signatures import _cpp_param_written, _triton_signature, kernel_signatures
from concur.inductor.wrapper_emit import launch_dag
from concur.inductor.wrapper_parse import parse_wrapper_source, source_namespace
from concur.inductor.wrapper_program import WORLD

HANDMADE = Path(__file__).parent / "fixtures" / "wrappers" / "handmade"


def by_code(program, text):
    """The statement whose source starts with ``text``."""
    (s,) = [s for s in program.statements if ast.unparse(s.node).startswith(text)]
    return s


def test_cooperative_reductions_sharing_semaphores_are_ordered():
    program = parse_wrapper_source((HANDMADE / "cooperative_reductions.py").read_text())
    zero = by_code(program, "semaphores_cuda_0.zero_()")
    total = by_code(program, "triton_red_fused_sum_0.run")
    amax = by_code(program, "triton_red_fused_amax_1.run")
    sem = by_code(program, "semaphores_cuda_0 = empty").bind_group
    workspace = by_code(program, "workspace_0 = empty").bind_group
    assert sem in total.writes and sem in amax.writes  # sem_ptr: spun on and reset by the kernel
    assert workspace in total.writes  # ws_ptr: peers' partial sums are stored there
    assert "arg0_1" in total.reads and "arg0_1" not in total.writes  # in_ptr0 is only loaded
    assert zero.kind == "launch" and zero.writes == {sem}  # not a barrier: a known in-place zeroing
    dag = launch_dag(program, {}, default_cost=1.0)
    assert nx.has_path(dag, total.index, amax.index)
    assert nx.has_path(dag, zero.index, total.index)


KERNEL = """
@triton_heuristics.pointwise(
    size_hints={{'x': 1024}},
    triton_meta={{'signature': {{{signature}}}, 'constants': {{}}}},
    inductor_meta={{'kernel_name': 'k', 'mutated_arg_names': []}},
)
@triton.jit
def k({params}, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
{body}
"""


def written(body: str, params: str = "in_ptr0, out_ptr0", signature: str | None = None) -> set[str]:
    """The parameters a triton kernel with this body counts as written."""
    if signature is None:
        signature = ", ".join(f"'{p.strip()}': '*fp32'" for p in params.split(",")) + ", 'xnumel': 'i32'"
    body = "\n".join("    " + line for line in body.strip().splitlines())
    sig = _triton_signature(KERNEL.format(signature=signature, params=params, body=body))
    assert sig is not None
    return set(sig.written)


def test_triton_pointer_only_loaded_is_read_only():
    assert written("""
tmp0 = tl.load(in_ptr0 + (xindex), xmask, eviction_policy='evict_last')
tl.store(out_ptr0 + (xindex), tmp0, xmask)
""") == {"out_ptr0"}


@pytest.mark.parametrize("use", [
    "tl.store(in_ptr0 + (xindex), tl.load(out_ptr0 + xindex), xmask)",   # stored through, whatever its name
    "tl.atomic_add(in_ptr0 + (xindex), 1.0, xmask)",
    "triton_helpers.x_grid_barrier(in_ptr0 + tl.program_id(1))",       # handed to a helper
    "p = in_ptr0 + xindex\ntl.store(p, 1.0, xmask)",                     # through a local
    "p = in_ptr0\np += xindex\ntl.store(p, 1.0, xmask)",
    "b = tl.make_block_ptr(in_ptr0, shape=[8], strides=[1], offsets=[0], block_shape=[8], order=[0])\n"
    "tl.store(b, tl.zeros([8], tl.float32))",
    "w = (in_ptr0 + 0).to(tl.pointer_type(tl.float32))\ntl.store(w + xindex, 1.0, xmask)",
])
def test_triton_pointer_used_any_other_way_counts_as_written(use):
    assert "in_ptr0" in written(use + "\ntl.store(out_ptr0 + xindex, 0.0, xmask)")


def test_triton_loads_through_locals_and_dtype_stay_read_only():
    # the shape of inductor's templates: ``A = arg_A``, offsets added in a loop, loads through the local
    assert written("""
A = arg_A
A = A + (xindex[:, None] * 4)
for k in range(4):
    a = tl.load(A, xmask, other=0.0)
    A += 4
tl.store(out_ptr0 + xindex, a.to(arg_A.dtype.element_ty), xmask)
""", params="arg_A, out_ptr0") == {"out_ptr0"}


def test_triton_scalars_are_not_written_but_unknown_parameters_are():
    # ks0 is a size: triton_meta says i64, so even when the wrapper passes a named value it is only read
    src = KERNEL.format(signature="'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'ks0': 'i64', 'xnumel': 'i32'",
                        params="in_ptr0, out_ptr0, ks0", body="    tl.store(out_ptr0 + xindex * ks0, 1.0, xmask)")
    assert _triton_signature(src).written == {"out_ptr0"}
    # without triton_meta nothing says ks0 is not a pointer, and its use is not a load
    bare = src.replace("'ks0': 'i64', ", "")
    assert "ks0" in _triton_signature(bare).written


def test_triton_tensor_descriptors_are_not_scalars():
    # a host-side TMA descriptor is not a pointer type, but the kernel stores through it
    src = KERNEL.format(signature="'in_ptr0': '*fp32', 'out_desc': 'tensordesc<fp32[16, 16]>', 'xnumel': 'i32'",
                        params="in_ptr0, out_desc", body="    out_desc.store([0, 0], tl.load(in_ptr0 + xindex))")
    assert _triton_signature(src).written == {"out_desc"}


@pytest.mark.parametrize("ctype, is_written", [
    ("const float*", False), ("float const*", False), ("const int64_t*", False), ("const bfloat16* __restrict__", False),
    ("float*", True), ("float* const", True), ("int64_t*", True),
    ("const int64_t", False), ("int64_t", False), ("double", False),
    ("at::Tensor&", True), ("const at::Tensor&", True), ("AtenTensorHandle", True),
])
def test_cpp_parameter_types(ctype, is_written):
    assert _cpp_param_written(ctype) is is_written


CPP_AND_EXTERN = """
import torch
from torch._inductor.select_algorithm import extern_kernels
aten = torch.ops.aten
cpp_fused_0 = async_compile.cpp_pybinding(['const float*', 'float* const', 'const int64_t'], '''
extern "C" void kernel(const float* in_ptr0, float* const out_ptr0, const int64_t ks0) {}
''')
triton_poi_1 = async_compile.triton('triton_poi_1', '''
@triton.jit
def triton_poi_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tl.store(out_ptr0 + xnumel, tl.load(in_ptr0 + xnumel))
''', device_str='cuda')

def call(args):
    arg0_1, arg1_1, s0 = args
    args.clear()
    buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
    cpp_fused_0(arg0_1, buf0, s0)
    buf1 = extern_kernels.mm(arg0_1, arg1_1, out=buf0)
    buf2 = extern_kernels.some_future_kernel(arg0_1, arg1_1)
    triton_poi_1.run(arg0_1, buf0, 4, stream=stream0, extra=arg1_1)
    buf3 = aten.add.Tensor(arg0_1, arg1_1)
    return (buf0, buf2, buf3, )
"""


def test_cpp_extern_and_keyword_arguments_fail_closed():
    program = parse_wrapper_source(CPP_AND_EXTERN)
    cpp = by_code(program, "cpp_fused_0(")
    buf0 = by_code(program, "buf0 = empty").bind_group
    assert cpp.writes == {buf0} and "arg0_1" in cpp.reads and "s0" not in cpp.writes
    mm = by_code(program, "buf1 = extern_kernels.mm")
    assert buf0 in mm.writes and "arg0_1" not in mm.writes and "arg1_1" not in mm.writes
    unknown = by_code(program, "buf2 = extern_kernels.some_future_kernel")
    assert unknown.kind == "launch" and {"arg0_1", "arg1_1"} <= unknown.writes
    triton = by_code(program, "triton_poi_1.run")
    assert "arg1_1" in triton.writes  # passed under a name the kernel does not have: counted as written
    assert "arg0_1" not in triton.writes
    add = by_code(program, "buf3 = aten.add.Tensor")  # resolved through the module's own ``aten = torch.ops.aten``
    assert add.kind == "launch" and "arg0_1" not in add.writes and WORLD in add.reads


def test_source_namespace_resolves_torch_attributes_without_running_anything():
    ns = source_namespace("import torch\naten = torch.ops.aten\nrt = os.system('false')\nx = torch.nope.nothing\n")
    assert ns["aten"] is torch.ops.aten and "rt" not in ns and "x" not in ns


def test_kernel_signatures_skip_cpp_kernels_with_unreadable_types():
    src = "k = async_compile.cpp_pybinding([T, 'float*'], '')\n"
    assert "k" not in kernel_signatures(src)


ALIASING = """
import torch
aten = torch.ops.aten
def call(args):
    arg0_1, arg1_1 = args
    args.clear()
    buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
    buf1 = empty_strided_cpu((4, ), (1, ), torch.int64)
    buf2 = torch.ops.aten.max.dim_max(arg0_1, 0, max=buf0, max_values=buf1)
    buf3 = torch.ops.aten.add.Tensor(*args)
    return (buf2, buf3, )
"""


def test_several_aliasing_returns_and_unpacked_arguments_are_barriers():
    program = parse_wrapper_source(ALIASING)
    # max.dim_max returns (Tensor(a!), Tensor(b!)): binding buf2 to one fresh storage would hide both aliases
    assert by_code(program, "buf2 = torch.ops.aten.max.dim_max").kind == "barrier"
    assert by_code(program, "buf3 = torch.ops.aten.add.Tensor(*args)").kind == "barrier"


HELPER_FIRST = """
@triton.jit
def helper(ptr, x):
    tl.store(ptr + x, 1.0)

@triton.jit
def kern(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    helper(in_ptr0, xnumel)
"""


def test_the_kernel_is_the_function_named_like_it_not_a_helper_before_it():
    sig = _triton_signature(HELPER_FIRST, "kern")
    assert sig.params == ("in_ptr0", "out_ptr0", "xnumel", "XBLOCK") and "in_ptr0" in sig.written
    assert _triton_signature(HELPER_FIRST) is None  # two jitted functions and no name: not guessed


ALIGNMENT_COPY = """
import torch
def call(args):
    arg0_1, arg1_1 = args
    args.clear()
    buf0 = extern_kernels.mm(arg1_1, arg1_1)
    arg0_1 = copy_if_misaligned(arg0_1)
    buf1 = extern_kernels.mm(arg0_1, arg0_1)
    return (buf0, buf1, )
"""


def test_an_alignment_copy_is_a_launch_its_readers_wait_for_and_others_do_not():
    """``x = copy_if_misaligned(x)`` (torch >= 2.14) may copy x on its stream: x's readers come after it."""
    program = parse_wrapper_source(ALIGNMENT_COPY)
    copy = by_code(program, "arg0_1 = copy_if_misaligned(arg0_1)")
    reader, other = by_code(program, "buf1 = extern_kernels.mm"), by_code(program, "buf0 = extern_kernels.mm")
    assert copy.kind == "launch" and copy.writes == {"arg0_1"} and copy.bind_group == "arg0_1"
    dag = launch_dag(program, {}, default_cost=1.0)
    assert nx.has_path(dag, copy.index, reader.index)
    assert not nx.has_path(dag, copy.index, other.index) and not nx.has_path(dag, other.index, copy.index)

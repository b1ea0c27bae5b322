"""What concur reads inductor's wrapper as: statements, the storage groups each touches, and the calls it knows.

:mod:`concur.inductor.wrapper_parse` turns the wrapper's ``call`` function
into a :class:`KernelProgram` of :class:`Statement` s;
:mod:`concur.inductor.wrapper_reuse` finds the reuse lines whose new buffer
may get storage of its own (:class:`Reuse`);
:mod:`concur.inductor.wrapper_emit` issues the launches on streams. The
names of the calls a wrapper makes (views, host checks, extern kernels) are
inductor's, read from its generated text: an unknown call is a barrier.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from concur.inductor.kernel_signatures import KernelSignature
from concur.inductor.syntax import subnodes

WORLD = "<world>"  # read by every launch, written by barriers

_VIEWS = {"reinterpret_tensor", "as_strided", "alias"}
_HOST_CHECKS = {"assert_size_stride", "assert_size_stride_grouped", "assert_tensor_metadata",
                "assert_alignment", "check_alignment", "set_device"}  # host-side only: no kernel
_STREAM_GETTERS = {"get_raw_stream"}
# ``x = copy_if_misaligned(x)`` (torch >= 2.14, CUDA): x itself, or a copy of it where its data is not aligned
# as the kernels reading it need
_ALIGNING_COPIES = {"copy_if_misaligned"}
# ``buf.zero_()``: how inductor zeroes a workspace or the graph's semaphores before the kernels using them
_INPLACE_METHODS = {"zero_"}
# extern kernels that write only their ``out=`` (and the tensor they return); any other writes every argument
_EXTERN_OUT_ONLY = {"convolution", "mm", "addmm", "bmm", "baddbmm", "bias_addmm", "_int_mm", "_mm_plus_mm",
                    "mm_dtype", "bmm_dtype", "_scaled_mm", "conv1x1_via_mm"}


@dataclass
class Statement:
    """One statement of the wrapper body, with what it needs and what it touches."""

    index: int                      # position in the original body
    node: ast.stmt
    kind: str                       # "launch", "barrier", "host", "del", "stream" (a raw-stream lookup)
    uses: frozenset[str]            # names read
    binds: frozenset[str]           # names (re)bound
    reads: frozenset[str] = frozenset()    # storage groups a launch reads
    writes: frozenset[str] = frozenset()   # storage groups a launch writes
    origins: tuple[str, ...] = ()   # fx nodes inductor lists in the comment above ("Source Nodes")
    groups: frozenset[str] = frozenset()   # storage groups of every name used or bound
    fresh: frozenset[str] = frozenset()    # groups this statement allocates (their home stream is its stream)
    bind_group: str | None = None   # the group of the name it binds (assignments)
    # groups a launch only stores to: every argument naming them is a pointer it never reads through
    stores_only: frozenset[str] = frozenset()
    # group -> element type, where every argument of a launch naming the group is one of its names passed
    # to a kernel pointer of a declared element type, and those types agree (see :attr:`KernelSignature.dtypes`)
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    # a launch that is not one of inductor's own kernels (an extern kernel, an aten call): it may allocate on the
    # stream it runs on (its outputs, a cuDNN or cuBLAS workspace), where inductor's kernels write only buffers
    # the wrapper made
    allocates: bool = False

    @property
    def is_launch(self) -> bool:
        return self.kind in ("launch", "barrier")


@dataclass
class KernelProgram:
    """The ``call`` function of an inductor wrapper, with its schedulable body parsed."""

    function: ast.FunctionDef
    body: list[ast.stmt]            # the list that is rescheduled (a device guard's body, or the function's)
    start: int                      # body[start:end] are the statements; the rest stays in place
    end: int
    statements: list[Statement]
    inputs: tuple[str, ...]         # names unpacked from ``args``
    outputs: tuple[str, ...]        # names in the return statement
    guarded: bool                   # the body is a device guard's (``with torch.cuda._DeviceGuard(0):``)
    reuses: tuple["Reuse", ...] = ()  # reuse lines whose new buffer has a storage group of its own
    reuse_lines: int = 0            # every ``bufN = bufM; del bufM  # reuse`` line, split or not

    @property
    def launches(self) -> list[Statement]:
        return [s for s in self.statements if s.is_launch]


@dataclass(frozen=True)
class Reuse:
    """A reuse line whose new buffer was given a storage group of its own (``split_reuses``).

    ``buf9 = buf5; del buf5  # reuse`` puts buf9 in buf5's dead memory,
    which orders buf9's first writer after every launch that touched buf5.
    When that writer only stores to buf9 (it never reads what buf5 left),
    the order is not a dependence: the parse gives buf9 a group of its own,
    and :func:`concur.inductor.wrapper_emit.plan_emission` keeps the reuse only
    where its schedule orders the two buffers anyway, otherwise it emits
    :attr:`fresh`, an allocation made like buf5's.
    """

    statement: int                  # index of the alias statement (``buf9 = buf5``)
    old_group: str
    new_group: str
    first_access: int               # index of the first launch touching the new group: it only stores to it
    fresh: Statement                # replaces the alias when the reuse is not kept
    # where the fresh allocation's layout comes from: "allocation" (the old buffer's allocator call, repeated)
    # or "stated" (the size and stride the wrapper states, the type the first kernel declares: _stated_fresh)
    made_from: str = "allocation"


class UnsupportedWrapper(ValueError):
    """The wrapper's shape is not one concur can reschedule; the graph then runs as inductor made it."""


# -- reading the call function's syntax ---------------------------------------------------------

def _names(node: ast.AST) -> set[str]:
    return {n.id for n in subnodes(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _stored(node: ast.AST) -> set[str]:
    return {n.id for n in subnodes(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


def _resolve(dotted: str, namespace: Mapping[str, Any]) -> Any:
    head, *rest = dotted.split(".")
    value = namespace.get(head)
    for atom in rest:
        if value is None:
            return None
        value = getattr(value, atom, None)
    return value


def _kernel_of(func: str, signatures: Mapping[str, KernelSignature]) -> KernelSignature | None:
    """Return the signature of the compiled kernel a call launches (``triton_poi_x.run``, ``cpp_fused_x``)."""
    return signatures.get(func[:-len(".run")] if func.endswith(".run") else func)


def _bind_schema(schema: torch.FunctionSchema, call: ast.Call) -> dict[str, ast.AST]:
    bound: dict[str, ast.AST] = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for arg, value in zip(positional, call.args):
        bound[arg.name] = value
    for k in call.keywords:
        if k.arg is not None:
            bound[k.arg] = k.value
    return bound

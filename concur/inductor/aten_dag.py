"""The dependency DAG of an AOTAutograd (aten-level) graph, costed as fused kernels.

The forward and backward graphs that ``torch.compile`` hands a backend are
functional aten graphs: almost every op returns a fresh tensor, so data edges
are nearly all there is. Three exceptions need ordering edges:

* ``operator.getitem`` unpacks a multi-output op; it is folded into its
  producer (same stream, no event), so the scheduler sees one node;
* an op whose schema mutates an argument (``copy_`` into a BatchNorm
  buffer) writes the value it mutates, named by its root through views; it is
  ordered after every earlier reader of that value and before every later
  one, with :func:`concur.dag.hazards.hazard_edges`, as for traced models;
* ops tagged ``nondeterministic_seeded`` (dropout masks, ``rand_like``,
  inductor's seed draws) read and write the generator, so they keep their
  program order.

Costs are for the kernels inductor will emit, not for the aten ops:
convolutions and matmuls stay separate (extern) kernels, costed by the
roofline of their FLOPs and bytes; pointwise and reduction ops are fused into
their neighbours, so each costs only the bytes it writes once; views cost
nothing. The estimate only has to rank branches, like :mod:`concur.dag.cost`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from concur import _torch_compat as compat
from concur.dag.annotate import RNG, tensors_in
from concur.dag.cost import Roofline, resource_shares
from concur.dag.hazards import hazard_edges


@dataclass(frozen=True)
class AtenCost:
    """Predicted cost of one aten op once inductor has fused it."""

    flops: int
    bytes_written: int
    bytes_read: int
    fused: bool  # pointwise/reduction work that inductor folds into a neighbouring kernel
    is_view: bool

    def microseconds(self, roof: Roofline) -> float:
        if self.is_view:
            return 0.0
        if not self.fused:
            compute = max(self.flops / roof.flops_per_us,
                          (self.bytes_read + self.bytes_written) / roof.bytes_per_us)
            return roof.kernel_overhead_us + compute
        # A fused op adds its output traffic to a kernel and shares its launch with others.
        return 0.25 * roof.kernel_overhead_us + self.bytes_written / roof.bytes_per_us

    def share(self, roof: Roofline) -> dict[str, float]:
        """Fractions of the device's arithmetic and memory bandwidth the kernel keeps busy alone.

        Its time at each resource's full rate over its whole predicted time (see
        :func:`concur.dag.cost.assign_costs`), for :func:`schedulers.simulate_shared`.
        """
        bytes_moved = self.bytes_written if self.fused else self.bytes_read + self.bytes_written
        return resource_shares({"compute": self.flops / roof.flops_per_us, "memory": bytes_moved / roof.bytes_per_us},
                               self.microseconds(roof))


def is_unpack(node: fx.Node) -> bool:
    """Return True for ``operator.getitem`` of a multi-output op."""
    return node.op == "call_function" and node.target is operator.getitem


def _schema(node: fx.Node) -> torch.FunctionSchema | None:
    return compat.op_schema(node.target)


def is_seeded_random(node: fx.Node) -> bool:
    """Return True if the op draws from (and advances) a random generator."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def is_view(node: fx.Node) -> bool:
    """Return True if the op's output aliases its input (no kernel)."""
    schema = _schema(node)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def root(node: fx.Node) -> fx.Node:
    """Return the op a value comes from: ``getitem`` nodes are folded into their producer."""
    while is_unpack(node):
        node = node.args[0]
    return node


def scheduled_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Return the nodes the scheduler places: every op except ``getitem`` unpacks, in program order."""
    return [n for n in graph.nodes if n.op == "call_function" and not is_unpack(n)]


def _meta_like(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _value(node: fx.Node) -> object:
    return node.meta.get("val")


def _flops(node: fx.Node) -> int:
    """Return the FLOPs torch's own formulas count for one op (torch.utils.flop_counter), run on meta tensors."""
    if compat.op_counts_no_flops(node.target):  # most ops: running them on meta tensors would say 0 anyway
        return 0
    try:  # meta tensors need no device to run
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda u: _meta_like(_value(u)))
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)
        return counter.get_total_flops()
    except Exception:  # noqa: BLE001 - no meta kernel or symbolic shapes: treat as fused pointwise work
        return 0


def aten_cost(node: fx.Node) -> AtenCost:
    """Return the fused-kernel cost of one op from the fake values AOTAutograd left in ``meta['val']``."""
    out_bytes = sum(t.numel() * t.element_size() for t in tensors_in(_value(node)))
    in_bytes = sum(t.numel() * t.element_size() for u in node.all_input_nodes
                   for t in tensors_in(_value(u)))
    if is_view(node):
        return AtenCost(0, 0, 0, fused=True, is_view=True)
    flops = _flops(node)
    return AtenCost(flops, out_bytes, in_bytes, fused=flops == 0, is_view=False)


def is_trivial(node: fx.Node, cost: AtenCost) -> bool:
    """Return True if the op does no arithmetic worth a stream: a view, or only tensors of at most one element.

    BatchNorm's ``num_batches_tracked + 1`` and its ``copy_`` back into the
    buffer are such ops: their time is a launch, which a side stream cannot
    overlap, so :func:`schedulers.coarsen` keeps them beside their data.
    """
    if cost.is_view:
        return True
    values = [_value(node), *(_value(u) for u in node.all_input_nodes)]
    tensors = [t for v in values for t in tensors_in(v)]
    sizes = [t.numel() for t in tensors]  # a symbolic size is never compared: no guard is added for it
    return cost.flops == 0 and bool(sizes) and all(type(k) is int and k <= 1 for k in sizes)


def build_aten_dag(graph: fx.Graph, roof: Roofline) -> nx.DiGraph:
    """Return the DAG of ``graph``'s scheduled nodes with ``cost`` (µs), ``share``, ``view``, ``heavy``,
    ``trivial`` (:func:`is_trivial`) and ``target``."""
    nodes = scheduled_nodes(graph)
    dag = nx.DiGraph()
    for n in nodes:
        cost = aten_cost(n)
        dag.add_node(n.name, cost=cost.microseconds(roof), share=cost.share(roof), view=cost.is_view,
                     heavy=not cost.fused, trivial=is_trivial(n, cost), target=str(n.target))
    for n in nodes:
        for u in n.all_input_nodes:
            u = root(u)
            if u.op == "call_function":
                dag.add_edge(u.name, n.name, kind="data")
    for u, v in hazard_edges(_accesses(nodes)):
        if not dag.has_edge(u, v):
            dag.add_edge(u, v, kind="hazard")
    return dag


def _accesses(nodes: list[fx.Node]) -> list[tuple[str, set, set]]:
    """Return (op, values read, values written) per op, values named by their root through views.

    Only mutating and random ops need ordering beyond data edges, so reads
    are tracked only for values that some op writes.
    """
    base: dict[fx.Node, fx.Node] = {}

    def storage(u: fx.Node) -> fx.Node:
        u = root(u)
        return base.get(u, u)

    for n in nodes:
        if is_view(n) and n.all_input_nodes:
            base[n] = storage(n.all_input_nodes[0])
    written: dict[fx.Node, set] = {}
    for n in nodes:
        schema = _schema(n)
        if schema is not None and schema.is_mutable:
            targets = [a for arg, a in zip(schema.arguments, n.args)
                       if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, fx.Node)]
            targets += [n.kwargs[arg.name] for arg in schema.arguments
                        if arg.alias_info is not None and arg.alias_info.is_write
                        and isinstance(n.kwargs.get(arg.name), fx.Node)]
            written[n] = {storage(a).name for a in targets}
        if is_seeded_random(n):
            written.setdefault(n, set()).add(RNG)
    mutated = set().union(*written.values()) if written else set()
    result = []
    for n in nodes:
        reads = {storage(u).name for u in n.all_input_nodes} & mutated
        result.append((n.name, reads, written.get(n, set())))
    return result

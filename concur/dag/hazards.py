"""Build the dependency DAG of a traced, annotated graph: data edges plus mutation hazards.

Nodes of the DAG are the names of the fx operation nodes (placeholders,
attribute reads and the output are free and are never scheduled). An edge
``u -> v`` means v may not start before u finishes. Data edges come from fx;
hazard edges come from the storages each op reads and writes
(:mod:`concur.dag.annotate`), walked in program order:

    x = conv(a)        reads a            a: readers [conv]
    y = relu_(a)       writes a           conv -> relu_   (write after read)
    z = add(a, 1)      reads a            relu_ -> add    (read after write)

so an in-place op runs after every earlier reader of its storage (views and
aliases included, since they share the storage) and before every later one;
two writers keep their order. Random-number draws read and write one virtual
storage, ``rng``, so dropout masks are drawn in the original order and a
seeded run gives the same numbers as the original model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import AbstractSet, Hashable, Iterable

import networkx as nx
import torch.fx as fx

from concur.dag.annotate import OP_KINDS, NodeFacts


def operation_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Return the nodes that run an operation, in program order."""
    return [n for n in graph.nodes if n.op in OP_KINDS]


def facts(node: fx.Node) -> NodeFacts:
    """Return the annotation of ``node`` (run :func:`concur.dag.annotate.annotate` first)."""
    try:
        return node.meta["concur"]
    except KeyError:
        raise ValueError(f"node {node.name} has no concur annotation; run annotate() first") from None


def build_dag(graph: fx.Graph) -> nx.DiGraph:
    """Return the DAG of operation nodes with ``kind="data"`` and ``kind="hazard"`` edges.

    Node attributes: ``target`` (a readable name of the op), ``facts``,
    ``trivial`` (``facts.no_arithmetic``: the schedulers keep such an op with
    its producer or consumer, see :func:`schedulers.attach_trivial`), and for
    memory-aware schedules (:mod:`schedulers.stream_memory`) ``bytes`` (what the op
    allocates) and ``held`` (its output lives to the end: saved for backward,
    or an output of the graph). Costs are added later by :mod:`concur.dag.cost`.
    """
    dag = nx.DiGraph()
    ops = operation_nodes(graph)
    returned = {u for n in graph.nodes if n.op == "output" for u in n.all_input_nodes}
    for n in ops:
        dag.add_node(n.name, target=describe(n), facts=facts(n), trivial=facts(n).no_arithmetic,
                     bytes=facts(n).alloc_bytes, held=facts(n).saved or n in returned)
    for n in ops:
        for u in n.all_input_nodes:
            if u.op in OP_KINDS:
                dag.add_edge(u.name, n.name, kind="data")
    for u, v in hazard_edges([(n.name, facts(n).reads, facts(n).writes) for n in ops]):
        if not dag.has_edge(u, v):
            dag.add_edge(u, v, kind="hazard")
    return dag


def is_free_source(dag: nx.DiGraph, name: str) -> bool:
    """Return True if the op launches no kernel and depends on nothing (e.g. a view of a buffer).

    Such an op does no GPU work, so no stream ever needs to wait for it.
    """
    return not dag.nodes[name]["facts"].launches_kernel and dag.in_degree(name) == 0


Access = tuple[str, AbstractSet[Hashable], AbstractSet[Hashable]]  # (op, reads, writes)


def hazard_edges(accesses: Iterable[Access]) -> set[tuple[str, str]]:
    """Return (earlier, later) pairs ordered by read/write conflicts on a shared storage.

    ``accesses`` lists, in program order, each op's name with the storages it
    reads and writes (any hashable keys: storage pointers for traced models,
    root values for aten graphs).
    """
    last_writer: dict[Hashable, str] = {}
    readers: dict[Hashable, list[str]] = defaultdict(list)
    edges: set[tuple[str, str]] = set()
    for name, reads, writes in accesses:
        for key in set(reads) | set(writes):
            writer = last_writer.get(key)
            if writer is not None and writer != name:
                edges.add((writer, name))  # read/write after write
            if key in writes:
                edges.update((r, name) for r in readers[key] if r != name)  # write after read
                readers[key] = []
                last_writer[key] = name
            else:
                readers[key].append(name)
    return edges


def describe(node: fx.Node) -> str:
    """Return a short human name of the op a node runs, e.g. ``conv2d`` or ``Conv2d``."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}"
    return getattr(node.target, "__name__", str(node.target))

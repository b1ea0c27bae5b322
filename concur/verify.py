"""Check generated code against the DAG, independently of the scheduler that produced it.

Walks the generated graph exactly as the runtime would issue it, keeping a
vector clock per stream (how far each stream is known to have progressed on
every other stream). An event snapshots its stream's clock; a wait merges it.
Every dependency of every operation must be known finished on the
operation's stream when it is issued. This catches a missing wait whether the
scheduler or the code generator dropped it.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from .annotate import OP_KINDS
from .graph import is_free_source


def verify_generated(generated: fx.Graph, dag: nx.DiGraph, num_streams: int) -> list[str]:
    """Return the problems found (empty when every DAG edge is honoured)."""
    problems: list[str] = []
    clock = [[0] * num_streams for _ in range(num_streams)]
    events: dict[int, list[int]] = {}
    position: dict[str, tuple[int, int]] = {}
    current = 0
    for n in generated.nodes:
        if n.op == "call_method" and n.args and getattr(n.args[0], "op", None) == "get_attr" \
                and str(n.args[0].target).startswith("_concur_runtime"):
            kind, args = n.target, n.args[1:]
            if kind == "switch":
                current = args[0]
            elif kind == "record":
                events[args[0]] = list(clock[current])
            elif kind == "wait":
                if args[0] not in events:
                    problems.append(f"wait on event {args[0]} before it is recorded")
                else:
                    clock[current] = [max(a, b) for a, b in zip(clock[current], events[args[0]])]
            continue
        if n.op not in OP_KINDS:
            continue
        if n.name not in dag:
            problems.append(f"{n.name} is not in the DAG")
            continue
        if n.name in position:
            problems.append(f"{n.name} issued twice")
        if is_free_source(dag, n.name):
            position[n.name] = (current, 0)  # no GPU work and no inputs: nothing to wait for
            continue
        for pred in dag.predecessors(n.name):
            if pred not in position:
                problems.append(f"{n.name} issued before its dependency {pred}")
                continue
            s, p = position[pred]
            if clock[current][s] < p:
                problems.append(f"{n.name} (stream {current}) may start before {pred} (stream {s}) ends")
        clock[current][current] += 1
        position[n.name] = (current, clock[current][current])
    missing = set(dag.nodes) - set(position)
    if missing:
        problems.append(f"never issued: {sorted(missing)[:5]}")
    return problems

"""Check generated code against the DAG, independently of the scheduler that produced it.

Turns the generated graph into the issue program the runtime follows
(switches, waits, launches, records) and replays it with
:func:`schedulers.replay`, the same vector-clock checker that validates
schedules and rewritten inductor wrappers: every dependency of every
operation must be known finished on the operation's stream when it is
issued. This catches a missing wait whether the scheduler or the code
generator dropped it.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

import schedulers

from concur.dag.annotate import OP_KINDS
from concur.dag.hazards import is_free_source


def issue_steps(generated: fx.Graph) -> list[tuple[str, object]]:
    """Return the generated graph as :func:`schedulers.replay` steps (runtime calls and ops, in order)."""
    steps: list[tuple[str, object]] = []
    for n in generated.nodes:
        if n.op == "call_method" and n.args and getattr(n.args[0], "op", None) == "get_attr" \
                and str(n.args[0].target).startswith("_concur_runtime"):
            if n.target in ("switch", "record", "wait"):
                steps.append((n.target, n.args[1]))
        elif n.op in OP_KINDS:
            steps.append(("issue", n.name))
    return steps


def verify_generated(generated: fx.Graph, dag: nx.DiGraph, num_streams: int) -> list[str]:
    """Return the problems found (empty when every DAG edge is honoured)."""
    steps = issue_steps(generated)
    used = max([0, *(a for op, a in steps if op == "switch")]) + 1
    problems = [] if used <= num_streams else [f"the code switches to stream {used - 1} of {num_streams}"]
    free = [v for v in dag.nodes if is_free_source(dag, v)]
    return problems + list(schedulers.replay(dag, steps, free).problems)

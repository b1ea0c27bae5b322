"""Small costed DAGs for the scheduler tests: a diamond, a fork-join, and random DAGs for hypothesis."""

from __future__ import annotations

import networkx as nx
from hypothesis import settings
from hypothesis import strategies as st


def costed(edges: list[tuple[str, str]], costs: dict[str, float]) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_nodes_from((v, {"cost": c}) for v, c in costs.items())
    dag.add_edges_from(edges)
    return dag


def diamond() -> nx.DiGraph:
    """a -> (b, c) -> d, two heavy branches of 10 between nodes of 1."""
    return costed(
        [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")],
        {"a": 1.0, "b": 10.0, "c": 10.0, "d": 1.0},
    )


def fork_join(branches: int, cost: float = 10.0) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_node("src", cost=1.0)
    for i in range(branches):
        dag.add_node(f"b{i}", cost=cost)
        dag.add_edge("src", f"b{i}")
    dag.add_node("sink", cost=1.0)
    dag.add_edges_from((f"b{i}", "sink") for i in range(branches))
    return dag


@st.composite
def random_dags(draw: st.DrawFn) -> nx.DiGraph:
    n = draw(st.integers(1, 30))
    dag = nx.DiGraph()
    # Insertion order is shuffled against the topological numbering, so program order
    # is not always 0..n-1.
    for i in draw(st.permutations(range(n))):
        dag.add_node(f"n{i}", cost=draw(st.floats(0, 100, allow_nan=False)))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    density = draw(st.floats(0, 0.5))
    for i, j in pairs:
        if draw(st.floats(0, 1)) < density:
            dag.add_edge(f"n{i}", f"n{j}")
    return dag


PROPS = settings(max_examples=150, deadline=None)

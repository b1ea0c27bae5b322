"""schedulers.stream_memory and the memory budget of schedulers.critical_path, on hand-drawn graphs and random ones."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedulers import critical_path, memory_budget, peak_bytes, stream_peaks, validate
from schedulers.schedule import insertion_order
from tests.dags import PROPS, random_dags


def chains(prefix: str, stem: str, join: str, length: int = 2) -> list[tuple[str, str]]:
    """Two branches of ``length`` nodes from ``stem`` to ``join``: ``prefix``b1.. and ``prefix``c1.."""
    edges = []
    for branch in "bc":
        nodes = [stem, *(f"{prefix}{branch}{i}" for i in range(1, length + 1)), join]
        edges += list(zip(nodes, nodes[1:]))
    return edges


def one_stream_peak(dag: nx.DiGraph) -> int:
    order = insertion_order(dag)
    return peak_bytes(dag, order, dict.fromkeys(order, 0))


def test_held_outputs_stay_live_to_the_end_and_others_go_with_their_last_reader():
    dag = nx.DiGraph([("a", "b"), ("b", "c")])
    nx.set_node_attributes(dag, {"a": 10, "b": 1, "c": 1}, "bytes")
    assert stream_peaks(dag, "abc", dict.fromkeys("abc", 0)) == [11]  # a freed once b ran
    dag.nodes["a"]["held"] = True  # saved for backward
    assert stream_peaks(dag, "abc", dict.fromkeys("abc", 0)) == [12]


def test_a_diamond_whose_branches_do_not_fit_side_by_side_keeps_them_on_one_stream_where_memory_binds():
    """Two branches of two nodes, 4 bytes a node: side by side on two streams they need 16 bytes, where one
    stream needs 12 (a stream's freed blocks never serve the other's join). Within 1.05x of the one-stream peak
    the branches share stream 0; with room for both, they run side by side."""
    dag = nx.DiGraph(chains("", "a", "d"))
    nx.set_node_attributes(dag, 5.0, "cost")
    nx.set_node_attributes(dag, 4, "bytes")
    unbounded = critical_path(dag, 2, sync_cost=0.0)
    assert peak_bytes(dag, unbounded.order, unbounded.stream) == 16 and one_stream_peak(dag) == 12
    bounded = critical_path(dag, 2, sync_cost=0.0, memory_budget=memory_budget(12))
    assert validate(dag, bounded) == []
    assert peak_bytes(dag, bounded.order, bounded.stream) <= 12 and bounded.streams_used == (0,)
    roomy = critical_path(dag, 2, sync_cost=0.0, memory_budget=16)
    assert roomy == unbounded, "concurrency where it fits is kept"


def test_for_training_a_side_stream_gets_the_branch_whose_saved_outputs_are_small():
    """Two branches beside a trunk, one saving 40 bytes for backward and one 2. In the program alone both fit
    beside the trunk; for training, what a side stream saves counts again (its freed blocks are lost to the
    caller's stream in backward), so within 1.05x of one stream only the small branch leaves stream 0."""
    dag = nx.DiGraph([("a", "t"), ("t", "z"), ("a", "w"), ("w", "z"), ("a", "n"), ("n", "z")])
    nx.set_node_attributes(dag, 5.0, "cost")
    nx.set_node_attributes(dag, {"a": 1, "t": 40, "w": 40, "n": 2, "z": 1}, "bytes")
    nx.set_node_attributes(dag, {"t": True, "w": True, "n": True}, "held")
    budget = memory_budget(one_stream_peak(dag))
    forward = critical_path(dag, 3, sync_cost=0.0, memory_budget=budget)
    training = critical_path(dag, 3, sync_cost=0.0, memory_budget=budget, training_memory=True)
    assert validate(dag, training) == []
    assert forward.stream["w"] != 0 and forward.stream["n"] != 0, "the program alone fits both beside the trunk"
    assert training.stream["w"] == 0 and training.stream["n"] != 0
    side_held = sum(dag.nodes[v]["bytes"] for v in dag if dag.nodes[v].get("held") and training.stream[v])
    assert peak_bytes(dag, training.order, training.stream) + side_held <= budget


def test_concurrency_is_limited_near_the_peak_and_kept_away_from_it():
    """An early fork of small tensors and a late fork of large ones (the start of backward, where every saved
    activation is alive, is such a place): the budget serializes the late fork only."""
    edges = chains("s", "a", "j") + chains("l", "j", "z")
    dag = nx.DiGraph(edges)
    nx.set_node_attributes(dag, 5.0, "cost")
    nx.set_node_attributes(dag, 1, "bytes")
    for v in ("lb1", "lb2", "lc1", "lc2"):
        dag.nodes[v]["bytes"] = 100
    for v in ("a", "sb1", "sb2", "sc1", "sc2"):
        dag.nodes[v]["held"] = True  # saved for backward: alive when the late fork runs
    budget = memory_budget(one_stream_peak(dag))
    free = critical_path(dag, 2, sync_cost=0.0)
    kept = critical_path(dag, 2, sync_cost=0.0, memory_budget=budget)
    assert {free.stream["sb1"], free.stream["sc1"]} == {0, 1} and {free.stream["lb2"], free.stream["lc2"]} == {0, 1}
    assert peak_bytes(dag, free.order, free.stream) > budget
    assert {kept.stream["sb1"], kept.stream["sc1"]} == {0, 1}, "the early fork stays concurrent"
    assert peak_bytes(dag, kept.order, kept.stream) <= budget
    assert validate(dag, kept) == []


def test_nodes_without_bytes_schedule_as_without_a_budget():
    dag = nx.DiGraph(chains("", "a", "d"))
    nx.set_node_attributes(dag, 5.0, "cost")
    assert critical_path(dag, 2, memory_budget=0) == critical_path(dag, 2)


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="factor must be >= 1"):
        memory_budget(100, factor=0.9)


@st.composite
def sized_dags(draw):
    dag = draw(random_dags())
    for v in dag.nodes:
        dag.nodes[v]["bytes"] = draw(st.integers(0, 64))
        dag.nodes[v]["held"] = draw(st.booleans())
    return dag


@PROPS
@given(dag=sized_dags(), k=st.integers(1, 6))
def test_a_budget_nothing_could_exceed_changes_nothing_and_every_bounded_schedule_is_valid(dag, k):
    free = critical_path(dag, k, sync_cost=0.0)
    everything = sum(b for _, b in dag.nodes(data="bytes"))
    assert critical_path(dag, k, sync_cost=0.0, memory_budget=everything) == free
    bounded = critical_path(dag, k, sync_cost=0.0, memory_budget=memory_budget(one_stream_peak(dag)))
    assert validate(dag, bounded) == []

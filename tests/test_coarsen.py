"""Tests for `schedulers.coarsen`: branches become clusters, and the expanded schedule stays valid.

Pure Python like the package it tests: no torch.
"""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedulers
from schedulers import SCHEDULERS, coarsen, expand, schedule, validate
from schedulers.coarsen import merge_small
from tests.dags import random_dags


def dag_of(edges: list[tuple[str, str]], costs: dict[str, float], heavy: set[str] | None = None,
           views: set[str] = frozenset()) -> nx.DiGraph:
    """A DAG inserted in ``costs``' order (program order); ``heavy=None`` leaves every node heavy."""
    dag = nx.DiGraph()
    for v, c in costs.items():
        dag.add_node(v, cost=c, view=v in views)
        if heavy is not None:
            dag.nodes[v]["heavy"] = v in heavy
    dag.add_edges_from(edges)
    return dag


def clusters(coarse: schedulers.Coarsened) -> list[list[str]]:
    return sorted(sorted(vs) for vs in coarse.members.values())


# ---------------------------------------------------------------- hand-drawn cases


def test_docstring_fork_join():
    dag = dag_of([("x", "a1"), ("a1", "a2"), ("x", "b1"), ("a2", "c"), ("b1", "c")],
                 {"x": 0.0, "a1": 2.0, "a2": 2.0, "b1": 1.0, "c": 0.0})
    assert clusters(coarsen(dag)) == [["a1", "a2"], ["b1"], ["c"], ["x"]]


def test_join_starts_its_own_cluster():
    # continuing one branch would make that whole branch wait for the other one
    dag = dag_of([("x", "a"), ("x", "b"), ("a", "c"), ("b", "c")], {"x": 1, "a": 1, "b": 9, "c": 1})
    assert clusters(coarsen(dag)) == [["a"], ["b"], ["c"], ["x"]]


def test_fork_consumers_start_separate_clusters():
    dag = dag_of([("x", "a"), ("x", "b"), ("x", "c")], {"x": 1, "a": 5, "b": 5, "c": 5})
    coarse = coarsen(dag)
    assert len({coarse.cluster_of[v] for v in "abc"}) == 3
    assert coarse.cluster_of["x"] not in {coarse.cluster_of[v] for v in "abc"}
    # the cluster DAG is the fork itself
    cx = coarse.cluster_of["x"]
    assert set(coarse.dag.successors(cx)) == {coarse.cluster_of[v] for v in "abc"}


def test_chain_is_one_cluster():
    dag = nx.path_graph(["a", "b", "c", "d"], create_using=nx.DiGraph)
    nx.set_node_attributes(dag, 1.0, "cost")
    coarse = coarsen(dag)
    assert list(coarse.members.values()) == [("a", "b", "c", "d")]
    assert coarse.dag.number_of_nodes() == 1 and coarse.dag.number_of_edges() == 0


def test_batchnorm_like_diamond_is_not_a_fork():
    # x's consumers mean and var meet again in norm before the next heavy node: one branch
    dag = dag_of([("x", "mean"), ("x", "var"), ("x", "norm"), ("mean", "norm"), ("var", "norm"),
                  ("norm", "conv")],
                 {"x": 5, "mean": 1, "var": 1, "norm": 1, "conv": 10}, heavy={"x", "conv"})
    assert clusters(coarsen(dag)) == [["conv", "mean", "norm", "var", "x"]]


def test_the_same_diamond_of_heavy_nodes_is_a_fork():
    dag = dag_of([("x", "mean"), ("x", "var"), ("x", "norm"), ("mean", "norm"), ("var", "norm"),
                  ("norm", "conv")],
                 {"x": 5, "mean": 1, "var": 1, "norm": 1, "conv": 10})
    coarse = coarsen(dag)
    assert coarse.cluster_of["mean"] != coarse.cluster_of["var"]


def test_running_stat_chain_is_not_a_fork():
    # x feeds a heavy conv and a cheap sink chain (a running-statistics update): not a fork
    edges = [("x", "conv"), ("x", "mul"), ("mul", "add"), ("add", "copy")]
    costs = {"x": 1, "conv": 5, "mul": 1, "add": 1, "copy": 1}
    assert clusters(coarsen(dag_of(edges, costs, heavy={"x", "conv"}))) == [
        ["add", "conv", "copy", "mul", "x"]]
    # the same chain made of heavy nodes is a branch of its own
    assert clusters(coarsen(dag_of(edges, costs))) == [["add", "copy", "mul"], ["conv"], ["x"]]


def test_heavy_attribute_name_is_configurable():
    dag = dag_of([("x", "a"), ("x", "b")], {"x": 1, "a": 5, "b": 5})
    nx.set_node_attributes(dag, {"x": True, "a": False, "b": False}, "big")
    assert clusters(coarsen(dag, heavy="big")) == [["a", "b", "x"]]
    assert len(coarsen(dag).members) == 3  # default attribute "heavy" absent: every node heavy


def test_all_cheap_consumers_are_one_cluster():
    dag = dag_of([("x", "a"), ("x", "b"), ("a", "c"), ("b", "c")], {"x": 1, "a": 5, "b": 5, "c": 1},
                 heavy=set())
    assert clusters(coarsen(dag)) == [["a", "b", "c", "x"]]


def test_views_go_with_their_input_and_free_sources_with_their_consumer():
    # v is a view of a; w is a free view with no input (a constant's transpose) read only by b
    dag = dag_of([("x", "a"), ("x", "b"), ("a", "v"), ("w", "b")],
                 {"x": 1, "a": 5, "v": 0, "w": 0, "b": 5}, views={"v", "w"})
    coarse = coarsen(dag)
    assert coarse.cluster_of["v"] == coarse.cluster_of["a"]
    assert coarse.cluster_of["w"] == coarse.cluster_of["b"] != coarse.cluster_of["a"]
    assert coarse.members[coarse.cluster_of["b"]] == ("w", "b")  # the source comes first


def test_join_does_not_continue_a_cluster_that_would_close_a_cycle():
    # c reads a and b; b depends on a's cluster through d: putting c in a's cluster would
    # make clusters {a, c} -> {d, b} -> {a, c}
    dag = dag_of([("x", "a"), ("x", "d"), ("a", "d2"), ("d2", "b"), ("d", "b"), ("a", "c"), ("b", "c")],
                 {"x": 1, "a": 50, "d": 1, "d2": 1, "b": 1, "c": 1})
    coarse = coarsen(dag)
    assert nx.is_directed_acyclic_graph(coarse.dag)


def test_min_cost_merges_a_cheap_branch_into_its_consumer():
    dag = dag_of([("x", "a"), ("x", "b"), ("a", "c"), ("b", "c")], {"x": 10, "a": 5, "b": 0.5, "c": 1})
    assert clusters(coarsen(dag)) == [["a"], ["b"], ["c"], ["x"]]
    # b (0.5) cannot go into its consumer c without making c wait for a as well: it joins x;
    # the join c (1) then goes into a, whose inputs already cover c's
    assert clusters(coarsen(dag, min_cost=2)) == [["a", "c"], ["b", "x"]]
    merged = coarsen(dag, min_cost=2)
    assert merged.dag.nodes[merged.cluster_of["b"]]["cost"] == pytest.approx(10.5)
    assert clusters(coarsen(dag, min_cost=100)) == [["a", "b", "c", "x"]]


def test_cluster_costs_are_member_sums_and_ids_follow_program_order():
    dag = dag_of([("x", "a1"), ("a1", "a2"), ("x", "b1")], {"x": 1.0, "a1": 2.0, "a2": 3.0, "b1": 4.0})
    coarse = coarsen(dag)
    assert coarse.members == {0: ("x",), 1: ("a1", "a2"), 2: ("b1",)}
    assert [coarse.dag.nodes[c]["cost"] for c in coarse.dag] == [1.0, 5.0, 4.0]
    assert list(coarse.dag) == [0, 1, 2]


def test_join_into_a_cluster_with_two_entries_keeps_the_cluster_dag_acyclic():
    # program order n4 n10 n5 n3 n2 n8; only n4 costs anything. n10 (free) joins n5's cluster,
    # so that cluster also starts at n3's edge; n8 then joins n3's cluster although it reads n5
    dag = dag_of([("n3", "n4"), ("n2", "n4"), ("n4", "n8"), ("n5", "n8"), ("n5", "n10"), ("n3", "n10")],
                 {"n4": 1.0, "n10": 0.0, "n5": 0.0, "n3": 0.0, "n2": 0.0, "n8": 0.0},
                 heavy={"n4", "n5", "n3", "n2"})
    coarse = coarsen(dag)
    assert nx.is_directed_acyclic_graph(coarse.dag), (coarse.members, list(coarse.dag.edges))


def test_expanded_fork_runs_branches_on_two_streams():
    dag = dag_of([("x", "a1"), ("a1", "a2"), ("x", "b1"), ("b1", "b2"), ("a2", "c"), ("b2", "c")],
                 {"x": 1, "a1": 10, "a2": 10, "b1": 10, "b2": 10, "c": 1})
    coarse = coarsen(dag)
    s = expand(dag, coarse, schedule(coarse.dag, 2, "critical_path", sync_cost=0.0))
    assert s.stream["a1"] == s.stream["a2"] != s.stream["b1"] == s.stream["b2"]
    assert validate(dag, s) == []
    assert len(s.waits) == 2  # into the second branch, and back into the join


# ---------------------------------------------------------------- properties


@st.composite
def flagged_dags(draw: st.DrawFn) -> nx.DiGraph:
    """`random_dags` with random ``heavy``, ``view`` and ``trivial`` flags (views are free, like the aten DAG's)."""
    dag = draw(random_dags())
    for v in dag:
        kind = draw(st.sampled_from(["heavy", "cheap", "view", "trivial", "unset"]))
        if kind == "view":
            dag.nodes[v].update(view=True, heavy=False, cost=0.0)
        elif kind == "trivial":
            dag.nodes[v].update(trivial=True, heavy=False)
        elif kind != "unset":
            dag.nodes[v]["heavy"] = kind == "heavy"
    return dag


def check_coarsened(dag: nx.DiGraph, coarse: schedulers.Coarsened) -> None:
    assert nx.is_directed_acyclic_graph(coarse.dag)
    assert set(coarse.dag) == set(coarse.members)
    flat = [v for vs in coarse.members.values() for v in vs]
    assert sorted(flat, key=str) == sorted(dag, key=str) and len(flat) == len(set(flat))
    assert all(coarse.cluster_of[v] == c for c, vs in coarse.members.items() for v in vs)
    for vs in coarse.members.values():
        for i, v in enumerate(vs):  # no later member is an ancestor of an earlier one
            assert not nx.ancestors(dag, v) & set(vs[i + 1:])
    for u, v in dag.edges:
        cu, cv = coarse.cluster_of[u], coarse.cluster_of[v]
        assert cu == cv or coarse.dag.has_edge(cu, cv)
    for c, vs in coarse.members.items():
        assert math.isclose(coarse.dag.nodes[c]["cost"], sum(dag.nodes[v].get("cost", 0.0) for v in vs),
                            rel_tol=1e-9, abs_tol=1e-9)


PROPS = settings(max_examples=150, deadline=None)


@PROPS
@given(dag=flagged_dags(), min_cost=st.sampled_from([0.0, 1.0, 20.0]))
def test_coarsened_dag_is_an_acyclic_partition_in_topological_order(dag, min_cost):
    check_coarsened(dag, coarsen(dag, min_cost=min_cost))


@PROPS
@given(dag=flagged_dags(), k=st.integers(1, 4), name=st.sampled_from(sorted(SCHEDULERS)),
       min_cost=st.sampled_from([0.0, 10.0]))
def test_expanded_schedule_is_valid(dag, k, name, min_cost):
    coarse = coarsen(dag, min_cost=min_cost)
    s = expand(dag, coarse, schedule(coarse.dag, k, name))
    assert validate(dag, s) == []
    assert 1 <= s.num_streams <= k
    assert all(s.stream[v] == s.stream[coarse.members[coarse.cluster_of[v]][0]] for v in dag)


@PROPS
@given(dag=flagged_dags())
def test_merge_small_with_a_huge_min_cost_stays_acyclic(dag):
    members = coarsen(dag).members
    merged = merge_small(dag, members, min_cost=1e12)
    check_coarsened(dag, merged)
    assert len(merged.members) <= len(members)


def test_an_unconnected_cheap_op_joins_a_cluster_instead_of_a_stream_of_its_own():
    # BatchNorm's num_batches_tracked + 1 depends on nothing and nothing depends on it
    dag = dag_of([("conv", "relu")], {"conv": 50.0, "relu": 1.0})
    dag.add_node("bump", cost=0.5)
    coarse = coarsen(dag, min_cost=10.0)
    assert clusters(coarse) == [["bump", "conv", "relu"]]
    assert expand(dag, coarse, schedule(coarse.dag, 4, "critical_path")).num_streams == 1


# ---------------------------------------------------------------- ops that do no arithmetic


def test_docstring_attach_trivial():
    dag = nx.DiGraph([("x", "a"), ("x", "i"), ("i", "b"), ("a", "c"), ("b", "c")])
    dag.add_node("n", trivial=True)
    dag.nodes["i"]["trivial"] = True
    assert clusters(schedulers.attach_trivial(dag)) == [["a"], ["b"], ["c", "n"], ["i", "x"]]


def test_a_trivial_source_joins_its_only_consumer_and_one_feeding_two_stays_alone():
    dag = dag_of([("s", "a"), ("t", "a"), ("t", "b")], {"s": 1.0, "t": 1.0, "a": 5.0, "b": 5.0})
    nx.set_node_attributes(dag, {"s": True, "t": True}, "trivial")
    assert clusters(schedulers.attach_trivial(dag)) == [["a", "s"], ["b"], ["t"]]


def test_a_trivial_join_that_would_close_a_cycle_stays_alone():
    # t reads u and p; p, its latest producer, shares a cluster with q, which u reads:
    # t joining {q, p} would make {q, p, t} -> u -> {q, p, t}
    dag = dag_of([("q", "u"), ("q", "p"), ("u", "t"), ("p", "t")], {"q": 1.0, "u": 1.0, "p": 1.0, "t": 0.0})
    dag.nodes["t"]["trivial"] = True
    coarse = schedulers.attach_trivial(dag, {0: ("q", "p"), 1: ("u",), 2: ("t",)})
    assert clusters(coarse) == [["p", "q"], ["t"], ["u"]]
    check_coarsened(dag, coarse)


def test_coarsen_attaches_an_unconnected_trivial_op_without_min_cost():
    """attach_trivial keeps BatchNorm's counter off a cluster (a stream) of its own even with min_cost=0 (no merge_small)."""
    dag = dag_of([("conv", "relu")], {"conv": 50.0, "relu": 1.0})
    dag.add_node("bump", cost=0.5, trivial=True)
    assert clusters(coarsen(dag)) == [["bump", "conv", "relu"]]


@pytest.mark.parametrize("name", ["critical_path", "fork"])
def test_schedulers_keep_a_trivial_op_on_its_producers_stream(name):
    # x forks into two heavy branches; the identity i beside them would otherwise get a stream and 2 waits
    dag = dag_of([("x", "a"), ("x", "b"), ("x", "i"), ("a", "c"), ("b", "c"), ("i", "c")],
                 {"x": 1.0, "a": 10.0, "b": 10.0, "i": 0.0, "c": 1.0})
    dag.add_node("bump", cost=2.0, trivial=True)  # an unconnected step counter
    dag.nodes["i"]["trivial"] = True
    s = schedule(dag, 4, name)
    assert s.stream["i"] == s.stream["x"] and s.num_streams == 2
    assert [w for w in s.waits if "i" in (w.producer, w.consumer)] == []
    assert len(s.waits) == 2 and validate(dag, s) == []


@PROPS
@given(dag=flagged_dags(), k=st.integers(1, 4), name=st.sampled_from(["critical_path", "fork"]))
def test_trivial_ops_with_one_producer_run_on_its_stream(dag, k, name):
    check_coarsened(dag, schedulers.attach_trivial(dag))
    s = schedule(dag, k, name)
    assert validate(dag, s) == []
    for v, trivial in dag.nodes(data="trivial"):
        if trivial and dag.in_degree(v) == 1:
            assert s.stream[v] == s.stream[next(iter(dag.predecessors(v)))]

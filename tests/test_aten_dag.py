"""concur.inductor.aten_dag: an aten graph's DAG, costed as the kernels inductor emits, with its hazard edges."""

from __future__ import annotations

import networkx as nx
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import schedulers
from concur.dag.cost import ROOFLINES
from concur.inductor.aten_dag import build_aten_dag

H100 = ROOFLINES["h100"]


def by_op(dag: nx.DiGraph) -> dict[str, list[str]]:
    ops: dict[str, list[str]] = {}
    for v in dag:
        ops.setdefault(dag.nodes[v]["target"].split(".")[1], []).append(v)
    return ops


def test_matmuls_are_kernels_of_their_own_pointwise_ops_are_fused_and_branches_stay_independent():
    def fork_join(x, w1, w2):
        return (torch.relu(x @ w1) + torch.sigmoid(x @ w2),)

    n = 256
    gm = make_fx(fork_join, tracing_mode="fake")(*(torch.randn(n, n) for _ in range(3)))
    dag = build_aten_dag(gm.graph, H100)
    ops = by_op(dag)
    mm1, mm2 = ops["mm"]
    assert not nx.has_path(dag, mm1, mm2) and not nx.has_path(dag, mm2, mm1)
    flops, moved = 2 * n ** 3, 3 * n * n * 4  # two inputs read and one output written, float32
    expected = H100.kernel_overhead_us + max(flops / H100.flops_per_us, moved / H100.bytes_per_us)
    assert dag.nodes[mm1]["heavy"] and abs(dag.nodes[mm1]["cost"] - expected) < 1e-9 * expected
    relu = dag.nodes[ops["relu"][0]]
    # A fused op writes its output once and shares a launch: a quarter of the overhead.
    assert not relu["heavy"] and relu["cost"] == 0.25 * H100.kernel_overhead_us + n * n * 4 / H100.bytes_per_us


def test_an_in_place_write_comes_after_the_earlier_reader_of_what_it_overwrites():
    def step(x, buf):
        before = buf * 2
        buf.copy_(x)
        return before, buf + 1

    gm = make_fx(step, tracing_mode="fake")(torch.randn(8), torch.randn(8))
    dag = build_aten_dag(gm.graph, H100)
    ops = by_op(dag)
    (mul,), (copy,), (add,) = ops["mul"], ops["copy_"], ops["add"]
    assert dag.edges[mul, copy]["kind"] == "hazard"  # no data flows from mul to copy_: only the write orders them
    assert nx.has_path(dag, copy, add)


def test_aten_step_counter_and_views_are_trivial_and_join_a_cluster_with_work():
    """BatchNorm's counter in a functional aten graph: 0-d int64 ``add`` then ``copy_`` back, beside real work."""
    def step(x, w, counter):
        bumped = counter + 1
        counter.copy_(bumped)
        return torch.mm(x, w).t(), torch.mm(w, x)

    gm = make_fx(step, tracing_mode="fake")(torch.randn(64, 64), torch.randn(64, 64), torch.zeros((), dtype=torch.int64))
    dag = build_aten_dag(gm.graph, H100)
    kinds = {dag.nodes[v]["target"].split(".")[1]: dag.nodes[v]["trivial"] for v in dag}
    assert kinds == {"add": True, "copy_": True, "t": True, "mm": False}
    coarse = schedulers.coarsen(dag)  # no min_cost: only attach_trivial keeps the counter off a stream of its own
    for vs in coarse.members.values():
        assert not all(dag.nodes[v]["trivial"] for v in vs), vs

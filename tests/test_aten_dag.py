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


def test_only_ops_that_can_count_flops_run_on_meta_tensors_and_the_costs_are_those_of_running_all(monkeypatch):
    """Running an op on meta tensors is most of the cost model's host time, and most ops count 0 FLOPs anyway.

    Each op with a FLOP formula (``mm``, ``addmm``) still runs under
    ``FlopCounterMode``; pointwise ops do not, and every node's cost is the
    one running all of them gives.
    """
    import concur.inductor.aten_dag as aten_dag

    def step(x, w1, w2, b):
        h = torch.relu(x @ w1) * torch.sigmoid(x @ w2)
        return (torch.ops.aten.linear.default(h, w1, b).tanh() + 1,)

    gm = make_fx(step, tracing_mode="fake")(*(torch.randn(64, 64) for _ in range(3)), torch.randn(64))
    runs = []  # one FlopCounterMode per op run on meta tensors

    def counting(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    real = aten_dag.FlopCounterMode
    monkeypatch.setattr(aten_dag, "FlopCounterMode", counting)
    lean = build_aten_dag(gm.graph, H100)
    kinds = sorted(str(n.target).split(".")[1] for n in aten_dag.scheduled_nodes(gm.graph))
    assert len(runs) == 3 and kinds.count("mm") == 2 and "addmm" in kinds  # make_fx made linear t and addmm
    monkeypatch.setattr(aten_dag.compat, "op_counts_no_flops", lambda target: False)  # every op runs, as before
    runs.clear()
    full = build_aten_dag(gm.graph, H100)
    assert len(runs) == len(kinds) - kinds.count("t") > 6  # views cost nothing and never run
    assert dict(lean.nodes(data=True)) == dict(full.nodes(data=True)) and set(lean.edges) == set(full.edges)
    assert sum(lean.nodes[v]["heavy"] for v in lean) == 3


def test_an_op_counts_no_flops_only_without_a_formula_and_without_a_decomposition():
    import operator

    from concur import _torch_compat as compat

    aten = torch.ops.aten
    assert compat.op_counts_no_flops(aten.add.Tensor) and compat.op_counts_no_flops(aten.relu.default)
    assert not compat.op_counts_no_flops(aten.mm.default)            # a formula
    assert not compat.op_counts_no_flops(aten.convolution.default)
    assert not compat.op_counts_no_flops(aten.linear.default)        # no formula, but it decomposes into addmm
    assert not compat.op_counts_no_flops(operator.getitem)           # not an op overload: run it, as before

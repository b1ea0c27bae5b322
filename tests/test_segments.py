"""Tests for `concur.aten_dag` and `concur.segments` on real AOTAutograd graphs (CPU).

The forward and backward aten graphs of small branchy models are captured
with ``aot_autograd``, together with the real inputs they were called with;
each is scheduled through coarsen/expand as the backend does, cut into
segments, and the segments are run one by one against an fx Interpreter run
of the whole graph.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import networkx as nx
import pytest
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

import schedulers
from concur.aten_dag import build_aten_dag, is_seeded_random, scheduled_nodes
from concur.cost import ROOFLINES
from concur.segments import SegmentedCall, SegmentPlan, partition, segment_module, verify
from tests.models import BufferMutation, DropoutBranches, WideNet

ROOF = ROOFLINES["h100"]


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def capture(model: torch.nn.Module, inputs: tuple, **aot_kw: Any) -> dict[str, tuple[fx.GraphModule, list]]:
    """Return {"fw": (gm, args), "bw": (gm, args)}: the aten graphs and the real values they ran on."""
    torch._dynamo.reset()
    graphs: dict[str, tuple[fx.GraphModule, list]] = {}

    def compiler(kind: str):
        def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Any:
            def run(args: list) -> Any:
                graphs[kind] = (gm, [_clone(a) for a in args])
                values = list(args)
                args.clear()
                return gm(*values)

            run._boxed_call = True
            return run
        return compile_graph

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=compiler("fw"),
                                                         bw_compiler=compiler("bw"), **aot_kw))
    torch.manual_seed(0)
    compiled(*inputs).sum().backward()
    torch._dynamo.reset()
    return graphs


MODELS = {
    "wide": lambda: capture(WideNet(branches=3, channels=4), (torch.randn(2, 3, 8, 8),)),
    "dropout": lambda: capture(DropoutBranches(), (torch.randn(4, 16),)),
    # keep_inference_input_mutations: the buffer updates stay in the graph as copy_ into inputs
    "buffers": lambda: capture(BufferMutation(), (torch.randn(2, 3, 8, 8),),
                               keep_inference_input_mutations=True),
}
_captured: dict[str, dict] = {}


def graph_of(model: str, kind: str) -> tuple[fx.GraphModule, list]:
    if model not in _captured:
        _captured[model] = MODELS[model]()
    return _captured[model][kind]


def plan_for(gm: fx.GraphModule, scheduler: str, streams: int = 4) -> tuple[nx.DiGraph, schedulers.Schedule,
                                                                             SegmentPlan]:
    dag = build_aten_dag(gm.graph, ROOF)
    coarse = schedulers.coarsen(dag)
    schedule = schedulers.expand(dag, coarse, schedulers.schedule(coarse.dag, streams, scheduler))
    assert schedulers.validate(dag, schedule) == []
    return dag, schedule, partition(gm.graph, schedule)


class Recorder(fx.Interpreter):
    """Runs a graph and keeps every node's value."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.values[n.name] = _clone(result) if isinstance(result, torch.Tensor) else result
        return result


def _boxed(module: fx.GraphModule):
    def run(values: list) -> Any:
        return module(*values)
    return run


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


CASES = [(m, k) for m in MODELS for k in ("fw", "bw")]
SCHEDULERS = ["critical_path", "fork"]


# ---------------------------------------------------------------- segments


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("model,kind", CASES)
def test_plan_is_a_verified_partition_in_dependency_order(model, kind, scheduler):
    gm, _ = graph_of(model, kind)
    _, schedule, plan = plan_for(gm, scheduler)
    assert verify(plan) == []
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    placed = [v for seg in plan.segments for v in seg.nodes]
    assert sorted(placed) == sorted(ops) and len(placed) == len(set(placed))
    made = set(plan.placeholders) | set(plan.constants)
    for seg in plan.segments:
        assert set(seg.inputs) <= made, f"segment {seg.index} reads values no earlier segment makes"
        assert {seg.stream} == {schedule.stream[v] for v in seg.nodes if v in schedule.stream}
        made |= set(seg.outputs)
    assert {o for o in plan.outputs if isinstance(o, str)} <= made
    assert [s.index for s in plan.segments] == list(range(len(plan.segments)))


@pytest.mark.parametrize("model,kind", CASES)
def test_waits_start_segments_and_events_end_them(model, kind):
    gm, _ = graph_of(model, kind)
    _, schedule, plan = plan_for(gm, "fork")
    segment_of = {v: seg for seg in plan.segments for v in seg.nodes}
    for w in schedule.waits:
        producer, consumer = segment_of[w.producer], segment_of[w.consumer]
        assert consumer.nodes[0] == w.consumer
        assert producer.event is not None and producer.event in consumer.waits
        # the producer is the segment's last op (only its getitem unpacks may follow)
        tail = producer.nodes[producer.nodes.index(w.producer) + 1:]
        by_name = {n.name: n for n in gm.graph.nodes}
        assert all(by_name[t].target is operator.getitem for t in tail)


def test_models_are_concurrent_enough_to_test_waits():
    # guards the tests below against passing vacuously on a one-stream plan
    for model, kind in [("wide", "fw"), ("wide", "bw"), ("dropout", "fw")]:
        _, schedule, plan = plan_for(graph_of(model, kind)[0], "fork")
        assert plan.num_streams > 1 and len(plan.segments) > 2 and schedule.waits, (model, kind)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("model,kind", CASES)
def test_dropping_any_data_wait_is_reported(model, kind, scheduler):
    gm, _ = graph_of(model, kind)
    _, _, plan = plan_for(gm, scheduler)
    made_by = {v: seg for seg in plan.segments for v in seg.outputs}
    checked = 0
    for seg in plan.segments:
        for e in seg.waits:
            producer = next(p for p in plan.segments if p.event == e)
            if not any(made_by.get(u) is producer for u in seg.inputs):
                continue  # a wait that only orders (a hazard), or covers a value through another event
            broken = dataclasses.replace(seg, waits=tuple(w for w in seg.waits if w != e))
            segments = plan.segments[:seg.index] + (broken,) + plan.segments[seg.index + 1:]
            problems = verify(dataclasses.replace(plan, segments=segments))
            assert problems and any(f"segment {seg.index}" in p for p in problems), (seg, e)
            checked += 1
    if model == "wide":
        assert checked > 0


def test_waiting_for_an_event_before_it_is_recorded_is_reported():
    gm, _ = graph_of("wide", "fw")
    _, _, plan = plan_for(gm, "fork")
    first = plan.segments[0]
    early = dataclasses.replace(first, waits=(plan.num_events - 1,))
    problems = verify(dataclasses.replace(plan, segments=(early,) + plan.segments[1:]))
    assert any("before it is recorded" in p for p in problems)


def test_reading_a_value_before_it_is_made_is_reported():
    gm, _ = graph_of("wide", "fw")
    _, _, plan = plan_for(gm, "critical_path")
    swapped = (plan.segments[1], plan.segments[0]) + plan.segments[2:]
    assert any("before any segment makes it" in p for p in verify(dataclasses.replace(plan, segments=swapped)))


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("model,kind", CASES)
def test_segment_modules_compute_the_original_values(model, kind, scheduler):
    gm, args = graph_of(model, kind)
    _, _, plan = plan_for(gm, scheduler)
    torch.manual_seed(7)
    recorder = Recorder(gm)
    expected_inputs = [_clone(a) for a in args]
    expected_out = recorder.run(*expected_inputs)
    expected = recorder.values

    # segments issued in plan order draw random numbers in program order: same seed, same masks
    torch.manual_seed(7)
    values = dict(zip(plan.placeholders, [_clone(a) for a in args]))
    values.update({c: expected[c] for c in plan.constants})
    for seg in plan.segments:
        module = segment_module(gm, seg)
        assert [n.name for n in module.graph.nodes if n.op == "placeholder"] == list(seg.inputs)
        results = module(*[values[u] for u in seg.inputs])
        assert isinstance(results, tuple) and len(results) == len(seg.outputs)
        for name, value in zip(seg.outputs, results):
            assert same(value, expected[name]), f"segment {seg.index}: {name} differs"
            values[name] = value
    actual_out = [values[o] if isinstance(o, str) else o for o in plan.outputs]
    assert same(actual_out, list(expected_out))
    # copy_ into an input (BufferMutation's buffers) happened in place, as in the whole graph
    for p, a in zip(plan.placeholders, expected_inputs):
        if isinstance(a, torch.Tensor):
            assert same(values[p], a), p


@pytest.mark.parametrize("model,kind", CASES)
def test_segmented_call_runs_the_plan_like_the_graph(model, kind):
    gm, args = graph_of(model, kind)
    _, _, plan = plan_for(gm, "fork")

    call = SegmentedCall(gm, plan, [_boxed(segment_module(gm, s)) for s in plan.segments])
    assert call._boxed_call is True
    torch.manual_seed(3)
    expected = gm(*[_clone(a) for a in args])
    torch.manual_seed(3)
    boxed_args = [_clone(a) for a in args]
    actual = call(boxed_args)
    assert boxed_args == []  # boxed convention: the runner took ownership of the inputs
    assert same(list(actual), list(expected))


def test_segment_outputs_keep_traced_strides():
    gm, _ = graph_of("wide", "bw")
    _, _, plan = plan_for(gm, "fork")
    by_name = {n.name: n for n in gm.graph.nodes}
    for seg in plan.segments:
        out = next(n for n in segment_module(gm, seg).graph.nodes if n.op == "output")
        assert out.meta["user_visible_output_idxs"] == list(range(len(seg.outputs)))
        assert out.meta["original_output_strides"] == [by_name[o].meta["val"].stride() for o in seg.outputs]


# ---------------------------------------------------------------- aten_dag


def test_getitem_is_folded_into_its_producer():
    gm, _ = graph_of("wide", "fw")
    dag = build_aten_dag(gm.graph, ROOF)
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert getitems and not any(n.name in dag for n in getitems)
    assert [n.name for n in scheduled_nodes(gm.graph)] == list(dag)
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    (unpack,) = relu.all_input_nodes
    assert unpack.target is operator.getitem
    assert list(dag.predecessors(relu.name)) == [unpack.args[0].name]


def _mutation_graph() -> fx.GraphModule:
    """Reads of ``buf`` (direct and through a view), ``copy_(buf, x)``, then reads of ``buf`` again."""
    def f(x, buf):
        early = torch.ops.aten.mul.Tensor(buf, 2.0)
        flat = torch.ops.aten.view.default(buf, [-1])
        early_sum = torch.ops.aten.sum.default(flat)
        torch.ops.aten.copy_.default(buf, x)
        late = torch.ops.aten.add.Tensor(buf, 1.0)
        late_view = torch.ops.aten.view.default(buf, [-1])
        late_sum = torch.ops.aten.sum.default(late_view)
        return early, early_sum, late, late_sum

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 3), torch.randn(2, 3))
    # make_fx routes later reads through copy_'s result; read the input itself, as AOTAutograd's
    # graphs do, so that only the hazard analysis can order them
    nodes = {n.name: n for n in gm.graph.nodes}
    buf = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("buf"))
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not torch.ops.aten.copy_.default:
            n.replace_input_with(nodes["copy_"], buf)
    gm.recompile()
    return gm


def test_copy_into_an_input_is_ordered_after_earlier_and_before_later_readers():
    gm = _mutation_graph()
    dag = build_aten_dag(gm.graph, ROOF)
    for reader in ("mul", "view", "sum_1"):  # readers before the write, the view's reader included
        assert nx.has_path(dag, reader, "copy_"), reader
    for reader in ("add", "view_1", "sum_2"):
        assert nx.has_path(dag, "copy_", reader), reader
    assert dag.edges["mul", "copy_"]["kind"] == "hazard"
    assert dag.edges["copy_", "add"]["kind"] == "hazard"
    # and the orders survive scheduling on several streams
    for name in schedulers.SCHEDULERS:
        s = schedulers.schedule(dag, 4, name)
        assert schedulers.validate(dag, s) == []
        pos = {v: i for i, v in enumerate(s.order)}
        assert pos["mul"] < pos["copy_"] < pos["add"]


def test_random_ops_are_chained_in_program_order():
    gm, _ = graph_of("dropout", "fw")
    dag = build_aten_dag(gm.graph, ROOF)
    random_ops = [n.name for n in scheduled_nodes(gm.graph) if is_seeded_random(n)]
    targets = {str(n.target) for n in gm.graph.nodes if is_seeded_random(n)}
    assert len(random_ops) >= 5, random_ops  # four dropouts, rand_like and the last dropout
    assert any("dropout" in t for t in targets) and any("rand" in t for t in targets), targets
    for a, b in zip(random_ops, random_ops[1:]):
        assert nx.has_path(dag, a, b), (a, b)
    # without those edges the branches' draws would be independent
    data_only = nx.DiGraph([(u, v) for u, v, k in dag.edges(data="kind") if k == "data"])
    data_only.add_nodes_from(dag)
    assert any(not nx.has_path(data_only, a, b) for a, b in zip(random_ops, random_ops[1:]))


def test_convolution_is_heavy_with_flops_and_views_are_free():
    gm, _ = graph_of("wide", "fw")
    dag = build_aten_dag(gm.graph, ROOF)
    by_target: dict[str, list[str]] = {}
    for v, target in dag.nodes(data="target"):
        by_target.setdefault(target, []).append(v)
    convs = by_target["aten.convolution.default"]
    from concur.aten_dag import aten_cost
    nodes = {n.name: n for n in gm.graph.nodes}
    for v in convs:
        assert aten_cost(nodes[v]).flops > 0
        assert dag.nodes[v]["heavy"] and dag.nodes[v]["cost"] > ROOF.kernel_overhead_us
    views = by_target["aten.view.default"] + by_target["aten.t.default"]
    assert views
    for v in views:
        assert dag.nodes[v]["view"] and dag.nodes[v]["cost"] == 0.0 and not dag.nodes[v]["heavy"]
    relu = by_target["aten.relu.default"][0]
    assert not dag.nodes[relu]["heavy"] and 0 < dag.nodes[relu]["cost"] < ROOF.kernel_overhead_us


def test_captured_graphs_hold_what_the_tests_rely_on():
    fw, _ = graph_of("buffers", "fw")
    assert sum(n.target is torch.ops.aten.copy_.default for n in fw.graph.nodes) == 2  # ema and calls
    bw, _ = graph_of("wide", "bw")
    assert any("convolution_backward" in str(n.target) for n in bw.graph.nodes)


@pytest.mark.parametrize("model,kind", CASES)
def test_delayed_events_merge_segments_and_stay_correct(model, kind):
    """max_event_delay lets a segment run past a waited-for op: fewer segments, same values, verified."""
    gm, args = graph_of(model, kind)
    dag, schedule, plan = plan_for(gm, "fork")
    cost = lambda name: dag.nodes[name]["cost"] if name in dag else 0.0  # noqa: E731
    delayed = partition(gm.graph, schedule, node_cost=cost, max_event_delay=1e9)
    assert verify(delayed) == []
    assert len(delayed.segments) <= len(plan.segments)
    segment_of = {v: seg for seg in delayed.segments for v in seg.nodes}
    for w in schedule.waits:  # waits still start segments; events may now come later
        assert segment_of[w.consumer].nodes[0] == w.consumer
        assert segment_of[w.producer].event in segment_of[w.consumer].waits
    call = SegmentedCall(gm, delayed, [_boxed(segment_module(gm, s)) for s in delayed.segments])
    torch.manual_seed(3)
    expected = gm(*[_clone(a) for a in args])
    torch.manual_seed(3)
    assert same(list(call([_clone(a) for a in args])), list(expected))


def test_delay_limit_bounds_the_work_after_a_waited_for_op():
    gm, _ = graph_of("wide", "bw")
    dag, schedule, plan = plan_for(gm, "fork")
    cost = lambda name: dag.nodes[name]["cost"] if name in dag else 0.0  # noqa: E731
    producers = {w.producer for w in schedule.waits}
    counts = []
    for limit in (0.0, 1e-9, 1e9):
        p = partition(gm.graph, schedule, node_cost=cost, max_event_delay=limit)
        counts.append(len(p.segments))
        for seg in p.segments:
            first = next((i for i, v in enumerate(seg.nodes) if v in producers), None)
            if first is not None:
                assert sum(cost(v) for v in seg.nodes[first + 1:]) <= limit
    assert counts[0] == len(plan.segments) and counts[2] < counts[0], counts
    with pytest.raises(ValueError, match="node_cost"):
        partition(gm.graph, schedule, max_event_delay=1.0)

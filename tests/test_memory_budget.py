"""Memory-aware plans on the fx path: what each op allocates and which outputs autograd saves (annotate), and the
budget the plan keeps to (concur.dag.memory_budget), on CPU against the plan scheduled without it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import concur
from concur.dag import decide
from concur.dag import memory_budget as dag_memory
from concur.dag.annotate import annotate
from concur.fx.plan import analyse, split_prologue
from schedulers.stream_memory import peak_bytes
from tests.models import Towers


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x))).sum()


class TwoTowers(nn.Module):
    """Two towers of wide layers on one stem: each tower's temporaries are alive together on its own stream."""

    def __init__(self, width=256, depth=4):
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.towers = nn.ModuleList(nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]) for _ in "ab")
        self.head = nn.Linear(2 * width, 4)

    def forward(self, x):
        h = self.stem(x)
        return self.head(torch.cat([t(h) for t in self.towers], dim=1))


def facts_by_target(gm: fx.GraphModule) -> dict[str, object]:
    return {str(n.target): n.meta["concur"] for n in gm.graph.nodes if "concur" in n.meta}


def test_annotate_says_what_each_op_allocates_and_which_outputs_autograd_saves():
    model = ConvBnRelu().train()
    gm = fx.symbolic_trace(model)
    x = torch.randn(2, 3, 5, 5)
    annotate(gm, (x,), saved=True)
    facts = facts_by_target(gm)
    assert facts["conv"].alloc_bytes == 2 * 4 * 5 * 5 * 4
    assert facts["conv"].saved, "BatchNorm saves its input"
    assert facts["act"].saved, "relu saves its output"
    assert not facts["bn"].saved, "relu does not save its input"
    annotate(gm, (x,))  # without gradients: nothing is saved, sizes are the same
    assert not any(f.saved for f in facts_by_target(gm).values())
    assert facts_by_target(gm)["conv"].alloc_bytes == facts["conv"].alloc_bytes


def test_a_training_forward_is_held_where_autograd_saves_it_and_an_eval_one_is_not():
    model = TwoTowers()
    x = torch.randn(8, 16)
    _, train_dag = analyse(model.train(), (x,))
    _, eval_dag = analyse(model.eval(), (x,))
    held = lambda dag: {v for v, h in dag.nodes(data="held") if h}  # noqa: E731
    assert len(held(train_dag)) > len(train_dag) // 2 and len(held(eval_dag)) == 1  # the output alone
    assert all(b > 0 for v, b in eval_dag.nodes(data="bytes") if "towers" in v)


def test_an_eval_plan_keeps_its_streams_memory_within_the_budget(monkeypatch):
    """Without a budget the two towers run side by side and need more memory than one stream; with it the plan
    keeps within 1.05x of the one-stream program's peak, still on two streams where that fits."""
    monkeypatch.setattr(dag_memory, "FLOOR", 0)  # past the floor, as with tensors of megabytes
    model = TwoTowers().eval()
    x = torch.randn(64, 16)
    _, dag = analyse(model, (x,))
    _, scheduled = split_prologue(dag)
    budget = dag_memory.plan_budget(scheduled, None)
    assert budget == int(dag_memory.one_stream_peak(scheduled) * dag_memory.FACTOR)
    free = decide.schedule_graph(scheduled, 2, "critical_path")
    assert peak_bytes(scheduled, free.order, free.stream) > budget
    plan = concur.optimize(model, (x,), streams=2, measure=False).plan
    assert peak_bytes(scheduled, plan.schedule.order, plan.schedule.stream) <= budget
    monkeypatch.setattr("concur.fx.module.plan_budget", lambda dag, device: None)
    unbounded = concur.optimize(model, (x,), streams=2, measure=False).plan
    assert peak_bytes(scheduled, unbounded.schedule.order, unbounded.schedule.stream) > budget


def test_the_budget_never_exceeds_what_the_device_has_free(monkeypatch):
    model = TwoTowers().eval()
    _, dag = analyse(model, (torch.randn(8, 16),))
    monkeypatch.setattr(dag_memory, "free_bytes", lambda device: 0)
    assert dag_memory.plan_budget(dag, None) == dag_memory.one_stream_peak(dag)


def test_a_plan_of_small_tensors_may_take_a_segment_more_than_the_factor_allows():
    """Tensors of a few KB: the allocator's segments are 2 MiB, so the budget is the floor above the peak."""
    _, dag = analyse(TwoTowers().eval(), (torch.randn(8, 16),))
    peak = dag_memory.one_stream_peak(dag)
    assert dag_memory.plan_budget(dag, None) == peak + dag_memory.FLOOR


def test_recording_which_outputs_are_saved_keeps_no_activation_alive():
    """The annotation run records autograd's graph but keeps none of what autograd saves: once annotate returns,
    no activation is left (an op that saves its own output, kept as it is, would hold itself in a cycle)."""
    import gc
    import weakref

    model = ConvBnRelu().train()
    gm = fx.symbolic_trace(model)
    seen = []

    def watch(module, args, output):
        seen.append(weakref.ref(output))

    gm.act.register_forward_hook(watch)
    annotate(gm, (torch.randn(2, 3, 5, 5),), saved=True)
    gc.collect()
    assert seen and seen[0]() is None, "relu's output (saved by relu itself) must be freed"


def test_recording_which_outputs_are_saved_keeps_no_model_alive():
    """Autograd keeps the saved-tensor hooks with what it saved: they must hold neither the annotator nor the traced
    model, or every plan would keep its model (and the run's output) alive for good."""
    import gc
    import weakref

    model = ConvBnRelu().train()
    gm = fx.symbolic_trace(model)
    out = annotate(gm, (torch.randn(2, 3, 5, 5),), saved=True)
    gone = weakref.ref(gm)
    del gm, model, out
    gc.collect()
    assert gone() is None, "the traced model outlived its annotation"


def test_a_budget_of_one_streams_memory_limits_concurrency_near_the_peak_and_keeps_it_elsewhere():
    """A held stem and two branches joined at the end (MiB): beside each other within 1.05x, the second branch's
    last op goes back to the caller's stream within 1.0x, its first op keeps the side stream."""
    import networkx as nx

    mib = 1 << 20
    dag = nx.DiGraph([("a", "b1"), ("b1", "b2"), ("b2", "d"), ("a", "c1"), ("c1", "c2"), ("c2", "d")])
    nx.set_node_attributes(dag, {"a": 1, "b1": 5, "b2": 5, "c1": 5, "c2": 5, "d": 1}, "cost")
    nx.set_node_attributes(dag, {"a": 400 * mib, "d": 4 * mib, **{v: 12 * mib for v in ("b1", "b2", "c1", "c2")}},
                           "bytes")
    nx.set_node_attributes(dag, {"a": True}, "held")
    one = dag_memory.one_stream_peak(dag)
    loose, tight = (decide.schedule_graph(dag, 2, "critical_path",
                                          memory_budget=dag_memory.plan_budget(dag, None, f)) for f in (1.05, 1.0))
    assert peak_bytes(dag, loose.order, loose.stream) > one + dag_memory.FLOOR >= \
        peak_bytes(dag, tight.order, tight.stream)
    assert (loose.stream["c1"], loose.stream["c2"]) == (1, 1) and (tight.stream["c1"], tight.stream["c2"]) == (1, 0)


def test_a_plan_for_trainings_memory_keeps_large_saved_activations_on_the_callers_stream(monkeypatch):
    """``memory_model="training"``: the wide towers' saved activations stay on stream 0, the narrow tower runs
    beside them; outputs and gradients equal the model's. The forward's budget alone puts a wide tower on a side
    stream."""
    monkeypatch.setattr(dag_memory, "FLOOR", 0)
    torch.manual_seed(0)
    model = Towers(64, (512, 512, 4)).double().train()  # two wide towers and a narrow one
    x = torch.randn(8, 6, dtype=torch.double)
    wide = {f"towers_{i}_{j}" for i in range(2) for j in range(2)}  # the wide Linear outputs and their Tanh
    on_side = lambda m: {v for v, s in m.schedule.stream.items() if s}  # noqa: E731
    forward = concur.optimize(model, (x,), streams=4, measure=False)
    training = concur.optimize(model, (x,), streams=4, measure=False, memory_model="training")
    assert on_side(forward) & wide
    assert not on_side(training) & wide and any(v.startswith("towers_2") for v in on_side(training))
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = training(x)
    out.sum().backward()
    assert torch.equal(out, expected) and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_an_unknown_memory_model_is_refused():
    with pytest.raises(ValueError, match="memory_model must be one of"):
        concur.optimize(TwoTowers(), (torch.randn(2, 16),), memory_model="backward")

"""Build a concurrent plan: trace → annotate → DAG → costs → schedule → generated code, all checked."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import networkx as nx
import torch
import torch.fx as fx

import schedulers
from schedulers import Schedule

from .annotate import annotate, tensors_in
from .capture import LeafSpec, trace
from .codegen import event_count, generate
from .cost import AnalyticCost, CostModel, assign_costs, roofline_for
from .errors import PlanError
from .graph import build_dag, is_free_source
from .runtime import StreamRuntime
from .verify import verify_generated

_plan_ids = itertools.count()


@dataclass(frozen=True)
class Plan:
    """One model, traced in one train/eval mode, scheduled on streams, as runnable code."""

    schedule: Schedule
    dag: nx.DiGraph
    generated: fx.GraphModule
    runtime: StreamRuntime
    runtime_attr: str
    traced: fx.GraphModule

    @property
    def forward(self) -> Callable:
        """The generated forward as a plain function taking the owning module as ``self``."""
        return type(self.generated).forward

    @property
    def code(self) -> str:
        """The Python source of the generated forward."""
        return self.generated.code


def device_name(model: torch.nn.Module, example_inputs: tuple) -> str:
    """Return the name of the device the model runs on ('cpu' or the CUDA device's name)."""
    tensors = tensors_in(example_inputs) + list(itertools.islice(model.parameters(), 1))
    cuda = next((t.device for t in tensors if t.is_cuda), None)
    return torch.cuda.get_device_name(cuda) if cuda is not None else "cpu"


def analyse(model: torch.nn.Module, example_inputs: tuple, cost_model: CostModel | None = None,
            leaf_modules: LeafSpec = ()) -> tuple[fx.GraphModule, nx.DiGraph]:
    """Return the traced GraphModule and its costed dependency DAG."""
    traced = trace(model, leaf_modules)
    annotate(traced, example_inputs)
    dag = build_dag(traced.graph)
    assign_costs(dag, cost_model or AnalyticCost(roofline_for(device_name(model, example_inputs))))
    return traced, dag


def hoistable(dag: nx.DiGraph) -> frozenset[str]:
    """Return the ops that launch no kernel and depend on nothing (e.g. views of buffers).

    They do no GPU work, so they can run before the fork, on the caller's
    stream, and nobody needs to wait for them; left to the scheduler they could
    land on a side stream and cost a pointless event wait.
    """
    return frozenset(n for n in dag if is_free_source(dag, n))


def build_plan(model: torch.nn.Module, example_inputs: tuple, streams: int, scheduler: str,
               cost_model: CostModel | None = None, leaf_modules: LeafSpec = ()) -> Plan:
    """Return a verified plan running ``model`` on up to ``streams`` streams.

    Raises:
        CaptureError: the model cannot be traced.
        PlanError: the schedule or the generated code violates a dependency (a concur bug).
    """
    traced, dag = analyse(model, example_inputs, cost_model, leaf_modules)
    prologue = hoistable(dag)
    scheduled = dag.subgraph(n for n in dag if n not in prologue).copy()
    schedule = schedulers.schedule(scheduled, streams, scheduler)
    problems = schedulers.validate(scheduled, schedule)
    runtime_attr = f"_concur_runtime_{next(_plan_ids)}"
    graph = generate(traced.graph, schedule, runtime_attr, prologue)
    problems += verify_generated(graph, dag, schedule.num_streams)
    if problems:
        raise PlanError(f"concur produced an invalid plan for {type(model).__name__} "
                        f"({scheduler}, {streams} streams); please report this bug: {problems[:5]}")
    runtime = StreamRuntime(schedule.num_streams, event_count(schedule))
    setattr(traced, runtime_attr, runtime)
    generated = fx.GraphModule(traced, graph, f"Concur{type(model).__name__}")
    return Plan(schedule, dag, generated, runtime, runtime_attr, traced)

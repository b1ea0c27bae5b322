"""Predict how long each operation takes, so the scheduler can weigh branches.

The analytic model is a roofline: an op takes the longer of its FLOPs over
the device's arithmetic rate and its bytes over memory bandwidth, plus a fixed
per-kernel overhead. It only needs to *rank* branches well, not to predict
absolute times. :class:`MeasuredCost` takes times measured on the device
(e.g. from ``torch.profiler``) and falls back to the analytic model for ops
it has no measurement of; both satisfy :class:`CostModel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import networkx as nx

from concur.dag.annotate import NodeFacts


@dataclass(frozen=True)
class Roofline:
    """Sustained rates of one device (not datasheet peaks)."""

    name: str
    flops_per_us: float
    bytes_per_us: float
    kernel_overhead_us: float


# Sustained, not peak: convolutions in fp32 run on TF32 tensor cores by default
# (cudnn.allow_tf32) at well under half of their 495 TFLOP/s dense peak.
ROOFLINES: dict[str, Roofline] = {
    "h100": Roofline("h100", flops_per_us=150e6, bytes_per_us=2.8e6, kernel_overhead_us=2.0),
    "h200": Roofline("h200", flops_per_us=150e6, bytes_per_us=4.0e6, kernel_overhead_us=2.0),
    "a100": Roofline("a100", flops_per_us=80e6, bytes_per_us=1.6e6, kernel_overhead_us=2.5),
    "gpu": Roofline("gpu", flops_per_us=40e6, bytes_per_us=0.8e6, kernel_overhead_us=3.0),
    "cpu": Roofline("cpu", flops_per_us=0.1e6, bytes_per_us=0.02e6, kernel_overhead_us=5.0),
}


def describe(cost_model: object) -> str:
    """Return one line naming the device a cost model predicts for, and its rates.

    >>> describe(AnalyticCost(ROOFLINES["h100"]))
    'h100 roofline (150 TFLOP/s, 2.8 TB/s, 2.0 us per kernel)'
    """
    if isinstance(cost_model, AnalyticCost):
        r = cost_model.roofline
        return (f"{r.name} roofline ({r.flops_per_us / 1e6:g} TFLOP/s, {r.bytes_per_us / 1e6:g} TB/s, "
                f"{r.kernel_overhead_us:.1f} us per kernel)")
    if isinstance(cost_model, MeasuredCost):
        return f"measured times of {len(cost_model.times_us)} ops, the rest by {describe(cost_model.fallback)}"
    return type(cost_model).__name__


def roofline_for(device_name: str) -> Roofline:
    """Return the roofline whose key appears in ``device_name`` (e.g. 'NVIDIA H100 80GB HBM3')."""
    lowered = device_name.lower()
    for key, roof in ROOFLINES.items():
        if key in lowered:
            return roof
    return ROOFLINES["cpu" if lowered == "cpu" else "gpu"]


class CostModel(Protocol):
    """Anything that predicts the run time of one DAG node in microseconds."""

    def node_cost(self, name: str, facts: NodeFacts) -> float: ...


@dataclass(frozen=True)
class AnalyticCost:
    """Roofline estimate from annotated FLOPs and bytes."""

    roofline: Roofline

    def node_cost(self, name: str, facts: NodeFacts) -> float:
        if not facts.launches_kernel:
            return 0.0
        return self.roofline.kernel_overhead_us + self.work_us(facts)

    def work_us(self, facts: NodeFacts) -> float:
        """Time of the op's work at the whole device's sustained rate, without launch overhead."""
        return max(self.resource_us(facts).values())

    def resource_us(self, facts: NodeFacts) -> dict[str, float]:
        """Time the op needs each resource of the whole device: arithmetic and memory bandwidth."""
        if not facts.launches_kernel:
            return {"compute": 0.0, "memory": 0.0}
        r = self.roofline
        return {"compute": facts.flops / r.flops_per_us, "memory": facts.bytes_moved / r.bytes_per_us}


@dataclass(frozen=True)
class MeasuredCost:
    """Measured per-node times (µs), with an analytic model for nodes that were not measured."""

    times_us: Mapping[str, float]
    fallback: CostModel = field(default_factory=lambda: AnalyticCost(ROOFLINES["gpu"]))

    def node_cost(self, name: str, facts: NodeFacts) -> float:
        if name in self.times_us:
            return float(self.times_us[name])
        return self.fallback.node_cost(name, facts)

    def resource_us(self, facts: NodeFacts) -> dict[str, float]:
        resource_us = getattr(self.fallback, "resource_us", None)
        return resource_us(facts) if resource_us else {}


def resource_shares(resource_us: Mapping[str, float], cost_us: float) -> dict[str, float]:
    """Fraction of each resource an op of total time ``cost_us`` keeps busy: its time at full rate over its time."""
    if cost_us <= 0:
        return {}
    return {resource: min(1.0, t / cost_us) for resource, t in resource_us.items()}


def assign_costs(dag: nx.DiGraph, model: CostModel) -> None:
    """Set the ``cost`` (µs) and ``share`` attributes of every DAG node from ``model``.

    ``share`` says how much of each device resource (arithmetic, memory
    bandwidth) an op keeps busy when it runs alone: the time it needs that
    resource at the device's full rate over its whole time, which also counts
    launch overhead and, for a measured op, whatever kept it from the full
    rate, such as too few blocks to fill the SMs. A small kernel leaves room
    beside it; one at the roofline leaves none of its bound resource.
    :func:`schedulers.simulate_shared` uses it.
    """
    resource_us = getattr(model, "resource_us", None)
    for name, data in dag.nodes(data=True):
        data["cost"] = cost = model.node_cost(name, data["facts"])
        data["share"] = resource_shares(resource_us(data["facts"]), cost) if resource_us and cost > 0 else {}

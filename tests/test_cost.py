"""concur.cost: the roofline's numbers, device names to rooflines, measured times first, shares, describe()."""

from __future__ import annotations

import doctest

import networkx as nx
import pytest
import torch

import concur
import concur.dag.cost
from concur.dag.annotate import NodeFacts
from concur.dag.cost import ROOFLINES, AnalyticCost, MeasuredCost, Roofline, assign_costs, describe, resource_shares, \
    roofline_for

ROOF = Roofline("test", flops_per_us=1000.0, bytes_per_us=100.0, kernel_overhead_us=2.0)


def _facts(flops: int, bytes_moved: int, kernel: bool = True) -> NodeFacts:
    return NodeFacts(frozenset(), frozenset(), frozenset(), flops, bytes_moved, kernel)


def test_an_op_takes_its_bound_resource_plus_the_launch_overhead():
    cost = AnalyticCost(ROOF)
    compute_bound, memory_bound = _facts(10_000, 100), _facts(1_000, 5_000)
    assert cost.resource_us(compute_bound) == {"compute": 10.0, "memory": 1.0}
    assert cost.node_cost("mm", compute_bound) == 2.0 + 10.0
    assert cost.node_cost("add", memory_bound) == 2.0 + 50.0
    assert cost.node_cost("view", _facts(0, 4096, kernel=False)) == 0.0  # a view launches nothing


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-40GB", "a100"), ("Tesla V100-SXM2-16GB", "gpu"),
                                       ("cpu", "cpu"), ("h100", "h100")])
def test_a_device_name_picks_its_roofline_and_unknown_gpus_the_generic_one(name, key):
    assert roofline_for(name) is ROOFLINES[key]


def test_measured_times_win_and_the_rest_fall_back_to_the_roofline():
    measured = MeasuredCost({"conv": 7.5}, fallback=AnalyticCost(ROOF))
    facts = _facts(10_000, 100)
    assert measured.node_cost("conv", facts) == 7.5
    assert measured.node_cost("other", facts) == 12.0
    assert measured.resource_us(facts) == {"compute": 10.0, "memory": 1.0}


def test_shares_are_time_at_full_rate_over_the_ops_time_capped_at_one():
    assert resource_shares({"compute": 10.0, "memory": 1.0}, 12.0) == {"compute": 10 / 12, "memory": 1 / 12}
    assert resource_shares({"compute": 30.0}, 12.0) == {"compute": 1.0}  # measured faster than the roofline
    assert resource_shares({"compute": 1.0}, 0.0) == {}


def test_assign_costs_writes_cost_and_share_on_every_node():
    dag = nx.DiGraph([("a", "b")])
    dag.nodes["a"]["facts"], dag.nodes["b"]["facts"] = _facts(10_000, 100), _facts(0, 0, kernel=False)
    assign_costs(dag, AnalyticCost(ROOF))
    assert dag.nodes["a"]["cost"] == 12.0 and dag.nodes["a"]["share"] == {"compute": 10 / 12, "memory": 1 / 12}
    assert dag.nodes["b"]["cost"] == 0.0 and dag.nodes["b"]["share"] == {}


def test_describe_names_the_device_and_its_rates():
    assert doctest.testmod(concur.dag.cost).failed == 0
    assert describe(AnalyticCost(ROOFLINES["cpu"])) == "cpu roofline (0.1 TFLOP/s, 0.02 TB/s, 5.0 us per kernel)"
    assert describe(MeasuredCost({"a": 1.0, "b": 2.0}, AnalyticCost(ROOFLINES["a100"]))) == \
        "measured times of 2 ops, the rest by a100 roofline (80 TFLOP/s, 1.6 TB/s, 2.5 us per kernel)"


def test_inspect_says_which_device_its_prediction_is_for():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    x = (torch.randn(1, 3, 8, 8),)
    assert concur.inspect(model, x).device_model.startswith("cpu roofline")  # where the inputs are
    h100 = concur.inspect(model, x, device="h100")
    assert h100.device_model.startswith("h100 roofline") and "device model       h100 roofline" in str(h100)
    assert concur.inspect(model, x, cost_model=AnalyticCost(ROOF)).device_model.startswith("test roofline")


def test_inspect_gives_the_calibrated_prediction_and_the_gpu_it_was_fitted_on():
    from concur.dag.calibration import calibration_for
    from tests.models import WideNet

    model, x = WideNet(), (torch.randn(2, 3, 16, 16),)
    fitted = calibration_for("h100")
    assert fitted is not None and not fitted.placeholder  # the shipped H100 fit (experiments/calibrate.py)
    h100 = concur.inspect(model, x, device="h100", max_streams=4)
    assert h100.calibrated_on == fitted.gpu and f"fitted to measurements on an {fitted.gpu}" in str(h100)
    for k, raw in h100.predicted_speedup.items():
        assert h100.calibrated_speedup[k] == pytest.approx(fitted.speedup(raw, h100.ideal_speedup[k]))
    assert h100.calibrated_speedup[4] < h100.predicted_speedup[4]  # the H100 delivers less than predicted
    a100 = concur.inspect(model, x, device="a100", max_streams=4)  # no measurements of this GPU: raw only
    assert a100.calibrated_speedup == {} and a100.calibrated_on is None and "calibrated" not in str(a100)

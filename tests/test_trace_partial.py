"""leaf_modules="auto": untraceable submodules become opaque leaves, the rest stays traced and concurrent."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import concur
from concur.fx.trace import trace
from tests.conftest import compare_with_original
from tests.models import DataDependentBlock, Untraceable, WideNet
from tests.nas_models import FactorizedReduce, GatedSepConv, NASNetStyle, RepeatedConv

UNTRACEABLE_OPS = (GatedSepConv, RepeatedConv, FactorizedReduce)


def nas_inputs():
    # 9 px: the cell after the reduction gets an odd-sized s0, so FactorizedReduce pads
    return (torch.randn(2, 3, 9, 9),)


def expected_leaves(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, UNTRACEABLE_OPS)}


def test_nas_cells_need_partial_capture():
    with pytest.raises(concur.CaptureError, match="GatedSepConv") as info:
        concur.optimize(NASNetStyle(layout="NRN"), nas_inputs())
    assert "leaf_modules='auto'" in str(info.value)


@pytest.mark.parametrize("scheduler", ["critical_path", "fork"])
def test_nas_cells_with_auto_leaves_match_original(scheduler):
    torch.manual_seed(0)
    model = NASNetStyle(layout="NRN").train()
    with pytest.warns(UserWarning, match=r"GatedSepConv.*cells\.0\.ops\.0\.0"):
        cm = compare_with_original(model, nas_inputs, streams=4, scheduler=scheduler, steps=3,
                                   leaf_modules="auto")
    # exactly the untraceable operations, not the cells around them: as much as possible stays traced
    assert set(cm.auto_leaves) == expected_leaves(model)
    assert len(cm.auto_leaves) == len(set(cm.auto_leaves))
    leaf_nodes = {n.name: str(n.target) for n in cm.plan.traced.graph.nodes
                  if n.op == "call_module" and str(n.target) in cm.auto_leaves}
    assert set(leaf_nodes.values()) == set(cm.auto_leaves)
    # concurrency between leaves: opaque operations are placed on more than one stream
    assert cm.schedule.num_streams > 1
    leaf_streams = {cm.schedule.stream[name] for name in leaf_nodes}
    assert len(leaf_streams) > 1, "the auto leaves all ran on one stream"


def test_nas_cells_eval_mode_and_inspection():
    torch.manual_seed(0)
    model = NASNetStyle(layout="NRN").eval()
    with pytest.warns(UserWarning, match="leaf_modules='auto'"):
        compare_with_original(model, nas_inputs, streams=3, steps=1, leaf_modules="auto")
        info = concur.inspect(model, nas_inputs(), leaf_modules="auto", max_streams=4)
    assert set(info.auto_leaves) == expected_leaves(model)
    assert info.predicted_speedup[4] > 1.2
    assert "auto leaves" in str(info)


class Outer(nn.Module):
    """Untraceable both inside its child and in its own forward: the outer module is the leaf."""

    def __init__(self):
        super().__init__()
        self.inner = DataDependentBlock()

    def forward(self, x):
        y = self.inner(x)
        return y * 2 if y.shape[0] > 1 else y


class TwoLevels(nn.Module):
    def __init__(self):
        super().__init__()
        self.outer = Outer()
        self.alone = DataDependentBlock()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.outer(x) + self.alone(x) + self.lin(x)


def test_deepest_failing_module_becomes_leaf():
    gm = _trace_quietly(Untraceable())
    assert gm.meta["concur_auto_leaves"] == ("block",)
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert called == ["pre", "block", "other"]


def test_a_leaf_inside_a_later_leaf_is_reported_once():
    gm = _trace_quietly(TwoLevels())
    assert set(gm.meta["concur_auto_leaves"]) == {"outer", "alone"}
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"\(1 Outer, 1 DataDependentBlock\).*: outer, alone;"):
        compare_with_original(TwoLevels(), lambda: (torch.randn(3, 4),), streams=2, leaf_modules="auto",
                              steps=1)


def test_root_control_flow_still_raises_and_fallback_still_works():
    # DataDependentBlock as the model itself: the control flow is in the root's own forward
    with pytest.raises(concur.CaptureError, match="DataDependentBlock"):
        concur.optimize(DataDependentBlock(), (torch.randn(2, 4),), leaf_modules="auto")
    model = DataDependentBlock()
    with pytest.warns(UserWarning, match="falls back"):
        assert concur.optimize(model, (torch.randn(2, 4),), leaf_modules="auto", fallback="eager") is model


def test_traceable_model_gets_no_leaves_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm = concur.optimize(WideNet(branches=3), (torch.randn(2, 3, 8, 8),), leaf_modules="auto")
    assert cm.auto_leaves == ()


def test_explicit_leaves_report_no_auto_leaves_and_bad_string_is_refused():
    cm = concur.optimize(Untraceable(), (torch.randn(2, 4),), leaf_modules=["block"])
    assert cm.auto_leaves == ()
    with pytest.raises(ValueError, match="auto"):
        concur.optimize(Untraceable(), (torch.randn(2, 4),), leaf_modules="block")


def _trace_quietly(model: nn.Module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(model, "auto")

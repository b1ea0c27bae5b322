"""concur.fx.trace: tracing errors name the module, the source line, and a fix that can work; fallback='eager'
warns and returns the model; leaf_modules="auto" makes untraceable submodules opaque leaves, the rest stays traced
and concurrent."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn

import concur
from concur.fx.trace import trace
from tests.conftest import compare_with_original
from tests.models import DataDependentBlock, Untraceable, WideNet
from tests.nas_models import FactorizedReduce, GatedSepConv, NASNetStyle, RepeatedConv


def gate(x):
    if x.sum() > 0:  # data-dependent: fx cannot trace it
        return x * 2
    return x - 1


def gated(x):
    if x.sum() > 0:
        return x * 2
    return x - 1


torch.fx.wrap("gated")  # the advice concur gives: fx calls `gated` as one operation


class RootControlFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x) + self.b(x)
        if h.sum() > 0:  # in the root's own forward
            h = h * 2
        return h


class RootCallsFunction(RootControlFlow):
    def forward(self, x):
        return gate(self.a(x)) + self.b(x)


class RootCallsWrapped(RootControlFlow):
    def forward(self, x):
        return gated(self.a(x)) + self.b(x)


def test_untraceable_model_raises_concur_error_naming_module_and_line():
    with pytest.raises(concur.CaptureError) as info:
        concur.optimize(Untraceable(), (torch.randn(2, 4),))
    err = info.value
    assert err.module_path == "block" and err.module_type == "DataDependentBlock"
    message = str(err)
    assert "`block` (DataDependentBlock)" in message
    assert "models.py" in message and "if x.sum() > 0:" in message
    assert "leaf_modules=[DataDependentBlock]" in message and "fallback='eager'" in message


def test_fallback_eager_returns_model_with_warning():
    model = Untraceable()
    with pytest.warns(UserWarning, match="falls back"):
        result = concur.optimize(model, (torch.randn(2, 4),), fallback="eager")
    assert result is model


@pytest.mark.parametrize("leaf", [DataDependentBlock, "block"])
def test_leaf_modules_make_it_traceable_and_exact(leaf):
    torch.manual_seed(0)
    compare_with_original(Untraceable(), lambda: (torch.randn(3, 4),), streams=2, leaf_modules=[leaf])


def test_control_flow_in_the_roots_forward_offers_what_can_work():
    with pytest.raises(concur.CaptureError) as info:
        concur.optimize(RootControlFlow(), (torch.randn(2, 4),))
    err, message = info.value, str(info.value)
    assert err.module_path == ""
    assert "RootControlFlow's own code" in message and "if h.sum() > 0:" in message
    assert "root module's own, not a submodule's, so no leaf module can keep it out" in message
    assert "fallback='eager'" in message and "torch.fx.wrap" in message
    assert "leaf_modules=[" not in message and "leaf_modules='auto'" not in message
    assert err.__cause__ is None and isinstance(err.original, torch.fx.proxy.TraceError)


def test_auto_leaves_that_fail_at_the_root_do_not_suggest_auto_again():
    with pytest.raises(concur.CaptureError) as info:
        concur.optimize(RootControlFlow(), (torch.randn(2, 4),), leaf_modules="auto")
    message = str(info.value)
    assert "(leaf_modules='auto' tried)" in message
    assert "or leaf_modules='auto'" not in message and "fallback='eager'" in message


def test_control_flow_in_a_function_the_root_calls_names_it_and_how_to_wrap_it():
    with pytest.raises(concur.CaptureError) as info:
        concur.optimize(RootCallsFunction(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "RootCallsFunction's own code in gate()" in message
    assert "torch.fx.wrap('gate') at the top level of test_trace.py" in message
    assert "register_notrace_function" not in message  # not a timm model


def test_the_advice_works_a_wrapped_function_is_one_operation():
    torch.manual_seed(0)
    cm = compare_with_original(RootCallsWrapped(), lambda: (torch.randn(3, 4),), streams=2)
    assert [n.target for n in cm.plan.traced.graph.nodes if n.op == "call_function"].count(gated) == 1


def test_timm_models_are_told_about_timms_own_mark():
    timm_like = type("TimmNet", (RootCallsFunction,), {"__module__": "timm.models.timm_net"})
    with pytest.raises(concur.CaptureError, match=r"timm\.layers\.register_notrace_function\(gate\)"):
        concur.optimize(timm_like(), (torch.randn(2, 4),))


def test_modules_and_functions_timm_marks_not_traced_are_honoured(monkeypatch):
    registry = types.SimpleNamespace(get_notrace_modules=lambda: [DataDependentBlock],
                                     get_notrace_functions=lambda: [gate, "a_name_fx_cannot_use"])
    monkeypatch.setitem(sys.modules, "timm.layers._fx", registry)
    torch.manual_seed(0)
    compare_with_original(Untraceable(), lambda: (torch.randn(3, 4),), streams=2)
    cm = compare_with_original(RootCallsFunction(), lambda: (torch.randn(3, 4),), streams=2)
    assert any(n.target is gate for n in cm.plan.traced.graph.nodes)


def test_timm_crossvit_traces_with_scale_image_kept_whole():
    timm = pytest.importorskip("timm", reason="needs timm, which the test extra installs: pip install -e \".[test]\"")
    torch.manual_seed(0)
    model = timm.create_model("crossvit_tiny_240", pretrained=False).eval()
    x = torch.randn(1, 3, 240, 240)
    cm = concur.optimize(model, (x,), streams=2)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-6)
    assert any(getattr(n.target, "__name__", "") == "scale_image" for n in cm.plan.traced.graph.nodes)


def test_a_timm_without_a_known_registry_is_traced_plainly_with_one_warning(monkeypatch):
    from concur.fx import trace

    monkeypatch.setitem(sys.modules, "timm", types.ModuleType("timm"))
    for name in trace._TIMM_FX_REGISTRIES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(trace, "_warned_timm", [])
    with pytest.warns(UserWarning, match="no fx registry in this timm version"):
        concur.optimize(Untraceable(), (torch.randn(2, 4),), leaf_modules=[DataDependentBlock])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        concur.optimize(Untraceable(), (torch.randn(2, 4),), leaf_modules=[DataDependentBlock])


# ---------------------------------------------------------------- leaf_modules="auto"

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


class AliasedResidual(nn.Module):
    """Two branches; ``out += ...`` writes into a tensor another name still refers to, as in eager PyTorch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.c = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        out = self.c(torch.relu(self.a(x)))
        kept = out  # the same tensor: the in-place add below changes it too
        out += self.b(x)
        out *= 0.5
        return torch.cat([kept, torch.sigmoid(out)], dim=1)


@pytest.mark.parametrize("split_weight_grads", [False, True])
def test_augmented_assignment_is_traced_as_the_in_place_op_the_model_runs(split_weight_grads):
    """fx alone traces ``out += y`` as ``out = out + y``: a new tensor, and another name for ``out`` (``kept``)
    would no longer see the change eager PyTorch makes. Here ``out`` is a convolution's output, which a split
    weight gradient ties to its layer (concur.fx.weight_grads)."""
    import operator

    gm = trace(AliasedResidual())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert operator.iadd in targets and operator.imul in targets
    assert operator.add not in targets and operator.mul not in targets
    optimized = compare_with_original(AliasedResidual(), lambda: (torch.randn(2, 3, 8, 8),), streams=2,
                                      split_weight_grads=split_weight_grads)
    assert (optimized.plan.weight_grad_splits > 0) == split_weight_grads


class ResidualTowers(nn.Module):
    """Residual blocks (``out += identity``, then ReLU in place) on parallel towers: the torchvision pattern."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(
            nn.ModuleDict({"conv": nn.Conv2d(4, 4, 3, padding=1, bias=False), "bn": nn.BatchNorm2d(4),
                           "relu": nn.ReLU(inplace=True)}) for _ in range(3))

    def forward(self, x):
        outs = []
        for t in self.towers:
            out = t["bn"](t["conv"](x))
            out += x
            outs.append(t["relu"](out))
        return torch.cat(outs, dim=1)


@pytest.mark.parametrize("split_weight_grads", [False, True])
def test_residual_adds_run_in_place_on_streams_with_the_models_results(split_weight_grads):
    """The model's ``add_`` kernels, not new tensors: counted with the profiler against the model's own."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    def aten_ops(model, x):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            model(x).sum().backward()
        return Counter(e.name for e in p.events() if e.name in ("aten::add", "aten::add_"))

    torch.manual_seed(0)
    optimized = compare_with_original(ResidualTowers(), lambda: (torch.randn(2, 4, 8, 8),), streams=3,
                                      split_weight_grads=split_weight_grads)
    assert optimized.schedule.num_streams > 1
    torch.manual_seed(0)
    model, x = ResidualTowers(), torch.randn(2, 4, 8, 8)
    assert aten_ops(concur.optimize(ResidualTowers(), (x,), streams=3), x) == aten_ops(model, x)

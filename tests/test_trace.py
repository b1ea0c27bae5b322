"""Tracing errors name the module, the source line, and a fix that can work; fallback='eager' warns and returns the model."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn

import concur
from tests.conftest import compare_with_original
from tests.models import DataDependentBlock, Untraceable


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
    import warnings

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

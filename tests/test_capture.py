"""Tracing errors name the module, the source line, and the fix; fallback='eager' warns and returns the model."""

from __future__ import annotations

import pytest
import torch

import concur
from tests.conftest import compare_with_original
from tests.models import DataDependentBlock, Untraceable


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

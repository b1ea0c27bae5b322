"""concur._torch_compat: version parsing, the tested range warns once outside it, version counters, small accessors."""

from __future__ import annotations

import warnings

import pytest
import torch

from concur import _torch_compat as compat


@pytest.mark.parametrize("version, expected", [("2.14.1", (2, 14)), ("2.11.0+cu130", (2, 11)),
                                               ("2.15.0.dev20261101", (2, 15)), ("3.0.0a0", (3, 0))])
def test_the_version_is_major_and_minor(version, expected, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    assert compat.torch_version() == expected


def test_outside_the_tested_range_the_backend_warns_once(monkeypatch):
    monkeypatch.setattr(compat, "_warned_untested", [])
    monkeypatch.setattr(compat, "TESTED_TORCH", ((2, 11), (2, 14)))
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 14))
    assert compat.untested_torch() is None
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 15))
    assert "outside the range concur's torch.compile backend was tested on (2.11 to 2.14)" in compat.untested_torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.warn_if_untested_torch()
        compat.warn_if_untested_torch()
    assert len(caught) == 1 and str(caught[0].message).startswith("concur backend: torch ")


def test_the_version_counter_counts_in_place_writes_through_views():
    t = torch.zeros(4)
    before = compat.version_counter(t)
    t[:2].add_(1)
    assert compat.version_counter(t) == before + 1
    with torch.inference_mode():
        assert compat.version_counter(torch.zeros(2)) == -1  # inference tensors have none


def test_symbolic_shapes_are_recognised():
    assert compat.has_symbolic_shapes([torch.zeros(2), 3]) is False
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    sym = ShapeEnv().create_unbacked_symint()
    assert compat.has_symbolic_shapes([sym]) is True


def test_buffer_reuse_is_set_inside_the_block_and_restored_after():
    from torch._inductor import config

    before = config.allow_buffer_reuse
    with compat.inductor_buffer_reuse(not before):
        assert config.allow_buffer_reuse is (not before)
    assert config.allow_buffer_reuse is before


def test_compile_phases_are_seconds_by_name():
    phases = compat.compile_phase_seconds()
    assert all(isinstance(k, str) and v >= 0 for k, v in phases.items())


def test_a_missing_internal_names_itself_and_the_tested_range():
    err = compat._compile_internal("torch._inductor.x", ImportError("gone"))
    low, high = compat.TESTED_TORCH
    assert f"needs torch._inductor.x, which torch {torch.__version__} does not provide (ImportError: gone)" in str(err)
    assert f"tested on torch {low[0]}.{low[1]} to {high[0]}.{high[1]}" in str(err)

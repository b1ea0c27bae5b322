"""Example inputs the model cannot run give concur's own error in a few lines: the argument and the fix.

Torch's exception stays reachable (``.original``, ``__context__``) but is not
printed; ``CONCUR_DEBUG=1`` chains it as ``__cause__`` so it is.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

import concur
from concur.errors import ExampleInputError


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.cat([self.conv1(x), self.conv2(x)], dim=1)
        return self.head(h.mean(dim=(2, 3)))


class TracesAnotherPath(nn.Module):
    """Takes a different path under fx than when run (as models do to stay traceable)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        if is_fx_symbolic_tracing():
            return self.lin(x.reshape(2, 6))  # a shape fixed at trace time
        return self.lin(x.reshape(-1, 6))


class OutOfMemory(nn.Module):
    def forward(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class WithOOMLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.big = OutOfMemory()

    def forward(self, x):
        return self.big(self.lin(x))


def setup_error(capfd, *args, entry=concur.optimize, **kwargs) -> ExampleInputError:
    with pytest.raises(ExampleInputError) as info:
        entry(*args, **kwargs)
    printed = capfd.readouterr()
    assert printed.err == "" and printed.out == "", "torch's traceback was printed"
    err = info.value
    assert err.__cause__ is None and err.__suppress_context__
    assert len(str(err).splitlines()) <= 3
    # the traceback goes from the caller to the public call only, not through concur's setup
    frames = traceback.extract_tb(info.tb)
    assert all(not in_concur(f) or f.name in ("optimize", "inspect", "_check_inputs")
               for f in frames), [f.name for f in frames]
    return err


PACKAGE = Path(concur.__file__).resolve().parent


def in_concur(frame: traceback.FrameSummary) -> bool:
    """Whether a frame runs concur's own code: a file of the package, wherever the checkout lies (not this test)."""
    return Path(frame.filename).resolve().is_relative_to(PACKAGE)


def test_frames_of_concur_are_told_by_the_package_not_by_the_checkouts_folder():
    # git clones into a folder named concur/ by default: its tests are not concur's frames
    clone_test = traceback.FrameSummary(f"{PACKAGE.anchor}elsewhere/concur/tests/test_errors.py", 1, "test")
    assert not in_concur(clone_test)
    assert not in_concur(traceback.extract_stack(limit=1)[0])
    assert in_concur(traceback.FrameSummary(str(PACKAGE / "fx" / "plan.py"), 1, "analyse"))


def test_wrong_dtype_names_the_argument_and_the_fix(capfd):
    err = setup_error(capfd, Branchy(), (torch.randn(2, 3, 8, 8, dtype=torch.float64),))
    assert err.argument == "example_inputs[0]"
    message = str(err)
    assert "example_inputs[0] is torch.float64 but the model's parameters are torch.float32" in message
    assert "x.to(torch.float32)" in message and "model.to(torch.float64)" in message
    assert "`conv1` (Conv2d)" in message and "CONCUR_DEBUG=1" in message
    assert isinstance(err.original, RuntimeError)
    chain, link = [], err  # kept as the context chain, which tools that look for a root cause walk
    while link is not None:
        chain.append(link)
        link = link.__cause__ or link.__context__
    assert chain[-1] is err.original
    assert "ShapeProp" not in message


def test_wrong_device_names_the_argument_and_the_fix(capfd):
    err = setup_error(capfd, Branchy(), (torch.randn(2, 3, 8, 8, device="meta"),))
    assert err.argument == "example_inputs[0]"
    assert "example_inputs[0] is on meta but the model's parameters are on cpu" in str(err)
    assert "x.to('cpu')" in str(err)


def test_an_input_the_model_rejects_names_the_failing_module(capfd):
    err = setup_error(capfd, Branchy(), (torch.randn(2, 5, 8, 8),))
    assert err.argument == "example_inputs"
    message = str(err)
    assert "float32[2, 5, 8, 8] on cpu" in message and "`conv1` (Conv2d)" in message
    assert "model(*example_inputs)" in message


def test_too_many_or_too_few_inputs(capfd):
    err = setup_error(capfd, Branchy(), (torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)))
    assert "holds 2 input(s)" in str(err) and "too many positional arguments" in str(err)
    err = setup_error(capfd, Branchy(), ())
    assert "missing a required argument: 'x'" in str(err)


def test_inspect_gives_the_same_error(capfd):
    err = setup_error(capfd, Branchy(), (torch.randn(2, 3, 8, 8, dtype=torch.float64),), entry=concur.inspect)
    assert err.argument == "example_inputs[0]"


def test_concur_debug_chains_torchs_traceback(monkeypatch):
    monkeypatch.setenv("CONCUR_DEBUG", "1")
    with pytest.raises(ExampleInputError) as info:
        concur.optimize(Branchy(), (torch.randn(2, 3, 8, 8, dtype=torch.float64),))
    assert info.value.__cause__ is info.value.original
    assert any(f.name == "_plan_for" for f in traceback.extract_tb(info.tb)), "full traceback kept"


def test_a_trace_that_fails_where_the_model_runs_is_a_capture_error(capfd):
    model = TracesAnotherPath()
    x = torch.randn(3, 6)
    model(x)  # the model itself runs
    with pytest.raises(concur.CaptureError) as info:
        concur.optimize(model, (x,))
    assert capfd.readouterr().err == ""
    assert "where the model itself runs" in str(info.value) and "fallback='eager'" in str(info.value)
    with pytest.warns(UserWarning, match="falls back"):
        assert concur.optimize(model, (x,), fallback="eager") is model


def test_running_out_of_memory_is_torchs_own_error():
    with pytest.raises(torch.OutOfMemoryError):
        concur.optimize(WithOOMLeaf(), (torch.randn(2, 4),), leaf_modules=[OutOfMemory])


def test_bad_inputs_at_a_later_call_raise_what_the_model_raises():
    model = Branchy()
    cm = concur.optimize(model, (torch.randn(2, 3, 8, 8),), streams=2)
    cm.eval()  # no plan for eval mode yet: the first call builds it on its inputs
    bad = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError) as expected:
        model(bad)
    with pytest.raises(RuntimeError) as actual:
        cm(bad)
    assert not isinstance(actual.value, concur.ConcurError)
    assert str(actual.value) == str(expected.value)

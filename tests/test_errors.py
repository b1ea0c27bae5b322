"""Example inputs the model cannot run give concur's own error in a few lines: the argument and the fix.

Torch's exception stays reachable (``.original``, ``__context__``) but is not
printed; ``CONCUR_DEBUG=1`` chains it as ``__cause__`` so it is.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

import concur
import concur.training.step as train_mod
from concur.errors import BatchError, ExampleInputError
from concur.training.batch_checks import BatchChecks


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


# ---------------------------------------------------------------- train_step: setup and calls


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Conv2d(3, 4, 3, padding=1)
        self.extra = nn.Linear(5, 4)
        self.head = nn.Linear(8, 2)

    def forward(self, x, v):
        return self.head(torch.cat([self.image(x).mean(dim=(2, 3)), self.extra(v)], dim=1))


def batch(n=2, channels=3, dtype=torch.float32, device="cpu", targets=None):
    return (torch.randn(n, channels, 8, 8, dtype=dtype, device=device),
            torch.randint(0, 2, (n if targets is None else targets,)))


def make_step(model=None, example=None, **kwargs):
    model = model or Branchy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the plan runs eagerly, as a warning says
        return concur.train_step(model, nn.CrossEntropyLoss(), optimizer, example or batch(), streams=2, **kwargs)


def call_error(capfd, step, *batch_) -> BatchError:
    with pytest.raises(BatchError) as info:
        step(*batch_)
    printed = capfd.readouterr()
    assert printed.err == "" and printed.out == "", "torch's traceback was printed"
    err = info.value
    assert err.__cause__ is None and err.__suppress_context__ and isinstance(err.original, Exception)
    assert str(err).startswith("concur: step(inputs, targets): ") and len(str(err).splitlines()) <= 3
    # from the caller straight to the public call: none of the plan's frames (fx/weight_grads.py, ...)
    frames = [f for f in traceback.extract_tb(info.tb) if in_concur(f)]
    assert [f.name for f in frames] == ["__call__"], [f.name for f in traceback.extract_tb(info.tb)]
    return err


def test_a_batch_with_other_channels_at_a_call_names_inputs_and_the_fix(capfd):
    step = make_step()
    step(*batch())
    err = call_error(capfd, step, *batch(channels=5))
    assert err.argument == "inputs" and isinstance(err.original, RuntimeError)
    message = str(err)
    assert "inputs has shape [2, 5, 8, 8] where example_batch's had [2, 3, 8, 8] (dimension 1 differs)" in message
    assert "`conv1` (Conv2d)" in message and "expected input[2, 5, 8, 8] to have 3 channels" in message
    assert "CONCUR_DEBUG=1" in message


def test_a_batch_of_another_dtype_or_device_names_the_fix(capfd):
    step = make_step()
    err = call_error(capfd, step, *batch(dtype=torch.float64))
    assert err.argument == "inputs"
    assert "inputs is torch.float64 but the model's parameters are torch.float32. Fix: pass " \
           "`inputs.to(torch.float32)`" in str(err)
    err = call_error(capfd, step, *batch(device="meta"))
    assert "inputs is on meta but the model's parameters are on cpu. Fix: pass `inputs.to('cpu')`" in str(err)


def test_with_several_inputs_the_error_names_the_one_at_fault(capfd):
    x, y = batch()
    step = make_step(TwoInputs(), ((x, torch.randn(2, 5)), y))
    step((x, torch.randn(2, 5)), y)
    err = call_error(capfd, step, (x, torch.randn(2, 7)), y)
    assert err.argument == "inputs[1]" and "inputs[1] has shape [2, 7] where example_batch's had [2, 5]" in str(err)
    assert "`extra` (Linear)" in str(err)


def test_targets_that_do_not_fit_the_loss_at_a_call_name_targets(capfd):
    step = make_step()
    err = call_error(capfd, step, *batch(targets=3))
    assert err.argument == "targets" and isinstance(err.original, ValueError)
    assert "loss_fn fails on the model's output (float32[2, 2] on cpu) and targets (int64[3] on cpu) " \
           "(3 targets for a batch of 2)" in str(err)
    assert "torch raised in loss_fn: ValueError: Expected input batch_size (2) to match target batch_size (3)" \
        in str(err)


def test_a_failed_call_does_not_count_in_the_accumulation_cycle(capfd):
    step = make_step(accumulate=2)
    step(*batch())
    call_error(capfd, step, *batch(channels=5))
    assert step.micro == 1  # the next good batch still ends the cycle


def test_a_new_batch_size_still_runs(capfd):
    step = make_step()
    assert torch.isfinite(step(*batch(n=5)))
    assert torch.isfinite(step(*batch(n=1)))


def test_a_failure_that_is_not_the_batchs_is_raised_unchanged():
    # the plan fixed a batch of 2 at trace time; the model itself runs on 3: the plan is at fault, not the batch
    model = TracesAnotherPath()
    step = make_step(model, (torch.randn(2, 6), torch.randint(0, 2, (2,))))
    x, y = torch.randn(3, 6), torch.randint(0, 2, (3,))
    with pytest.raises(RuntimeError) as info:
        step(x, y)
    assert not isinstance(info.value, concur.ConcurError) and "shape '[2, 6]' is invalid" in str(info.value)


def test_concur_debug_chains_torchs_error_at_a_call(monkeypatch):
    step = make_step()
    monkeypatch.setenv("CONCUR_DEBUG", "1")
    with pytest.raises(BatchError) as info:
        step(*batch(channels=5))
    assert info.value.__cause__ is info.value.original
    assert any(f.name == "forward" for f in traceback.extract_tb(info.value.original.__traceback__))


def test_the_error_class_is_concurs_and_a_runtime_error():
    assert issubclass(BatchError, concur.ConcurError) and issubclass(BatchError, RuntimeError)
    assert concur.BatchError is BatchError


# ---- under (emulated) CUDA graphs: a bad batch is caught before it is captured


from tests.test_step_habits import graphs  # noqa: E402,F401 (a fixture: train_step's graph path on CPU)


def test_under_graphs_a_bad_batch_is_refused_before_capture_and_costs_no_streams(graphs, capfd):
    step = make_step()
    assert step.cuda_graph
    step(*batch())
    assert graphs.captures == 1
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        err = call_error(capfd, step, *batch(channels=5))
        assert err.argument == "inputs" and "dimension 1 differs" in str(err)
        call_error(capfd, step, *batch(targets=3))
    assert not warned, [str(w.message) for w in warned]  # no "capturing the step with 2 stream(s) failed"
    assert graphs.captures == 1 and not step.failed_streams and not step.eager_keys
    step(*batch(n=5))  # a new batch size gets its own graph, on the streams asked for
    assert graphs.captures == 2 and {c.streams for c in step.graphs.values()} == {2}


def test_under_graphs_a_batch_is_tried_only_before_its_graph_is_captured(graphs, monkeypatch):
    step = make_step()
    tried = []
    real = BatchChecks._try
    monkeypatch.setattr(BatchChecks, "_try", lambda self, *a, **k: tried.append(1) or real(self, *a, **k))
    for _ in range(3):
        step(*batch())
        step(*batch(n=5))
    assert graphs.captures == 2 and len(tried) == 2  # replays try nothing


def test_eagerly_a_good_call_tries_nothing(monkeypatch):
    step = make_step()
    monkeypatch.setattr(BatchChecks, "_try", lambda *a, **k: pytest.fail("a good batch was tried"))
    step(*batch())
    step(*batch(n=5))


# ---- at setup


def setup_frames(info) -> list[str]:
    return [f.name for f in traceback.extract_tb(info.tb) if in_concur(f)]


def test_targets_that_do_not_fit_the_loss_fail_at_setup(capfd):
    with pytest.raises(ExampleInputError) as info:
        make_step(example=batch(targets=3))
    err = info.value
    assert capfd.readouterr().err == ""
    assert err.argument == "example_batch[1]" and isinstance(err.original, ValueError)
    assert "loss_fn fails on the model's output (float32[2, 2] on cpu) and example_batch[1] (int64[3] on cpu) " \
           "(3 targets for a batch of 2)" in str(err)
    assert "`loss_fn(model(example_batch[0]), example_batch[1])`" in str(err)
    assert setup_frames(info) == ["train_step", "__init__", "__init__"]


def test_a_loss_that_is_not_one_number_fails_at_setup():
    model = Branchy()
    with pytest.raises(ExampleInputError, match=r"returns float32\[2\] on cpu, not one number"):
        concur.train_step(model, nn.CrossEntropyLoss(reduction="none"), torch.optim.SGD(model.parameters(), lr=0.1),
                          batch(), cuda_graph=False)


def test_setup_errors_use_train_steps_argument_names(capfd):
    with pytest.raises(ExampleInputError) as info:
        make_step(example=batch(dtype=torch.float64))
    err = info.value
    assert err.argument == "example_batch[0]" and "example_inputs" not in str(err)
    assert "example_batch[0] is torch.float64 but the model's parameters are torch.float32" in str(err)
    assert "before concur.train_step" not in str(err) or "concur.optimize" not in str(err)
    x, y = batch()
    with pytest.raises(ExampleInputError) as info:
        make_step(TwoInputs(), ((x, torch.randn(2, 5, dtype=torch.float64)), y))
    assert info.value.argument == "example_batch[0][1]"
    with pytest.raises(ExampleInputError) as info:
        make_step(example=(torch.randn(2, 5, 8, 8), y))
    assert "`model(example_batch[0])` accepts" in str(info.value) and "example_inputs" not in str(info.value)
    assert capfd.readouterr().err == ""


def test_an_error_that_is_not_the_batchs_fault_goes_through_unchanged():
    """A model raising something no bad batch causes (here a user's own exception class) is not told as the batch's
    fault: the CUDA sanitizer's race report, for one, must reach the user as it is."""
    class Race(Exception):
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1  # 1: fx traces it; 2: the batch check runs it
            if self.calls == 2:
                raise Race("detected 1 errors")
            return self.fc(x)

    model = Model()
    with pytest.raises(Race):
        concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                          (torch.randn(3, 4), torch.zeros(3, dtype=torch.long)), streams=1)

"""The optimized module is the user's model in every habit: modes, copies, saving, EMA, dtype, state dicts.

Each habit is compared with the unmodified model in float64, outputs to 1e-9.
"""

from __future__ import annotations

import copy
import io
import threading
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import concur

TOL = dict(rtol=0, atol=1e-9)


class RootDropout(nn.Module):
    """Two branches, BatchNorm, and a dropout in the root's own forward reading ``self.training``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)
        self.num_classes = 4  # a plain attribute, as models keep them

    def forward(self, x):
        h = self.bn(self.a(x) + torch.tanh(self.b(x)))
        h = F.dropout(h, 0.5, self.training)
        return self.head(h)


class FrozenBN(RootDropout):
    """Overrides ``train`` to keep its BatchNorm in eval mode, as detection backbones do."""

    def train(self, mode: bool = True):
        super().train(mode)
        self.bn.eval()
        return self


class ExtraState(RootDropout):
    """Keeps a Python value in its state dict (``get_extra_state``) at the root."""

    def __init__(self):
        super().__init__()
        self.version_tag = "v1"

    def get_extra_state(self):
        return {"tag": self.version_tag}

    def set_extra_state(self, state):
        self.version_tag = state["tag"]


@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make(cls=RootDropout, seed=0):
    torch.manual_seed(seed)
    model = cls()
    return model, concur.optimize(model, (torch.randn(6, 8),), streams=3)


def run_both(model, optimized, x, seed=7):
    """Outputs of the original and the optimized module on the same input and dropout seed."""
    torch.manual_seed(seed)
    expected = model(x)
    torch.manual_seed(seed)
    return optimized(x), expected


def flags(model):
    return [m.training for m in model.modules()]


# --- train/eval ---------------------------------------------------------------------------------

def test_eval_on_the_original_is_seen_by_the_optimized_module():
    model, cm = make()
    model.eval()
    assert not cm.training
    x = torch.randn(5, 8)
    actual, expected = run_both(model, cm, x)
    torch.testing.assert_close(actual, expected, **TOL)  # root-level F.dropout(h, p, self.training) off
    assert not model.training, "running the optimized module switched the original back to train"
    model.train()
    assert cm.training
    actual, expected = run_both(model, cm, x)
    torch.testing.assert_close(actual, expected, **TOL)


def test_eval_and_train_on_the_optimized_module_are_seen_by_the_original():
    model, cm = make()
    assert cm.eval() is cm
    assert flags(model) == [False] * len(flags(model))
    x = torch.randn(5, 8)
    actual, expected = run_both(model, cm, x)
    torch.testing.assert_close(actual, expected, **TOL)
    cm.train()
    assert flags(model) == [True] * len(flags(model))
    actual, expected = run_both(model, cm, x)
    torch.testing.assert_close(actual, expected, **TOL)


def test_running_never_changes_the_original_flags():
    model, cm = make()
    model.eval()
    model.bn.train()  # a mixed mode: BatchNorm updating its statistics under an eval root
    before = flags(model)
    x = torch.randn(5, 8)
    actual, expected = run_both(model, cm, x)
    assert flags(model) == before and flags(cm) == before
    torch.testing.assert_close(actual, expected, **TOL)


def test_train_runs_the_original_models_own_train():
    model, cm = make(FrozenBN)
    model.eval()
    cm.train()
    assert model.training and not model.bn.training, "cm.train() skipped the model's own train()"
    actual, expected = run_both(model, cm, torch.randn(5, 8))
    torch.testing.assert_close(actual, expected, **TOL)


# --- copies --------------------------------------------------------------------------------------

def assert_independent_copy(copied, model, cm):
    assert isinstance(copied, concur.ConcurModule)
    assert copied.original is not model
    # the copy keeps the relationship: its parameters are its own original's, not the user's
    assert [id(p) for p in copied.parameters()] == [id(p) for p in copied.original.parameters()]
    assert not {id(p) for p in copied.parameters()} & {id(p) for p in model.parameters()}
    # and the optimized module still is a view onto the user's model
    assert [id(p) for p in cm.parameters()] == [id(p) for p in model.parameters()]
    for mode in ("train", "eval"):
        getattr(model, mode)()
        getattr(copied, mode)()
        actual, expected = run_both(model, copied, torch.randn(5, 8))
        torch.testing.assert_close(actual, expected, **TOL)
    with torch.no_grad():
        next(copied.parameters()).add_(1.0)
    assert not torch.equal(next(copied.parameters()), next(model.parameters()))


def test_deepcopy_is_an_independent_equal_module():
    model, cm = make()
    assert_independent_copy(copy.deepcopy(cm), model, cm)


def test_deepcopy_of_model_and_optimized_module_together_keeps_them_one_model():
    model, cm = make()
    model_copy, cm_copy = copy.deepcopy((model, cm))
    assert cm_copy.original is model_copy
    assert [id(p) for p in cm_copy.parameters()] == [id(p) for p in model_copy.parameters()]


def test_pickle_round_trip():
    model, cm = make()
    assert_independent_copy(pickle.loads(pickle.dumps(cm)), model, cm)


def test_torch_save_and_load_of_the_whole_module_keeps_its_mode():
    model, cm = make()
    cm.eval()
    buffer = io.BytesIO()
    torch.save(cm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not loaded.training and not loaded.original.bn.training
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), **TOL)
        cm(x)
    assert loaded.schedule.stream == cm.schedule.stream  # the same plan, rebuilt on the first call
    assert_independent_copy(loaded, model, cm)


def test_a_copy_made_before_any_call_plans_on_its_first_call():
    model, cm = make()
    copied = copy.deepcopy(cm)
    with pytest.raises(RuntimeError, match="call the module once"):
        copied.plan
    copied(torch.randn(5, 8))
    assert copied.schedule.num_streams == cm.schedule.num_streams


def test_averaged_model_ema_matches_the_plain_model():
    model, cm = make()
    reference = copy.deepcopy(model)
    ema_fn = get_ema_multi_avg_fn(0.9)
    ema, ema_ref = (AveragedModel(m, multi_avg_fn=ema_fn, use_buffers=True) for m in (cm, reference))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    torch.manual_seed(3)
    batches = [torch.randn(5, 8) for _ in range(3)]
    for step, x in enumerate(batches):
        for net, opt, averaged in ((cm, opts[0], ema), (reference, opts[1], ema_ref)):
            torch.manual_seed(step)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
            averaged.update_parameters(net)
    for p, q in zip(ema.parameters(), ema_ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    ema.eval()
    ema_ref.eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(ema(x), ema_ref(x), **TOL)
    assert not ema.module.original.training, "the EMA copy's mode is its original's"


# --- dtype, device, state dicts -----------------------------------------------------------------

@pytest.mark.parametrize("convert", ["float", "half", "to_float32"])
def test_dtype_conversion_through_the_optimized_module_converts_the_model(convert):
    model, cm = make()
    reference = copy.deepcopy(model)
    result = {"float": cm.float, "half": cm.half, "to_float32": lambda: cm.to(torch.float32)}[convert]()
    assert result is cm
    dtype = torch.float16 if convert == "half" else torch.float32
    assert all(p.dtype == dtype for p in model.parameters())
    reference.to(dtype)
    x = torch.randn(5, 8, dtype=dtype)
    actual, expected = run_both(reference, cm, x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)  # the same kernels in the same dtype
    cm.double()
    actual, expected = run_both(reference.double(), cm, x.double())
    torch.testing.assert_close(actual, expected, **TOL)


def test_state_dict_round_trips_both_ways():
    model, cm = make()
    other, _ = make(seed=1)
    x = torch.randn(5, 8)
    cm.load_state_dict(other.state_dict())
    actual, expected = run_both(other, cm, x)
    torch.testing.assert_close(actual, expected, **TOL)
    fresh = RootDropout()
    fresh.load_state_dict(cm.state_dict())
    actual, expected = run_both(fresh, cm, x)
    torch.testing.assert_close(actual, expected, **TOL)


def test_state_dict_carries_the_roots_extra_state():
    model, cm = make(ExtraState)
    assert cm.state_dict().keys() == model.state_dict().keys()
    assert cm.state_dict()["_extra_state"] == {"tag": "v1"}
    state = model.state_dict()
    state["_extra_state"] = {"tag": "v2"}
    cm.load_state_dict(state)
    assert model.version_tag == "v2"


def test_attributes_the_module_lacks_are_the_originals():
    model, cm = make()
    assert cm.num_classes == 4
    model.num_classes = 5
    assert cm.num_classes == 5
    with pytest.raises(AttributeError):
        cm.no_such_attribute


# --- the training step ----------------------------------------------------------------------------

def test_torch_save_of_a_train_step_resumes_the_same_run():
    torch.manual_seed(0)
    model = RootDropout()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    step = concur.train_step(model, nn.MSELoss(), optimizer, (x, y), streams=2, cuda_graph=False)
    step(x, y)
    buffer = io.BytesIO()
    torch.save(step, buffer)
    buffer.seek(0)
    resumed = torch.load(buffer, weights_only=False)
    assert resumed.module.original is resumed.model
    for _ in range(2):
        torch.manual_seed(11)
        loss = step(x, y)
        torch.manual_seed(11)
        torch.testing.assert_close(resumed(x, y), loss, **TOL)
    for p, q in zip(model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, **TOL)


def test_a_saved_train_step_keeps_no_graphs_or_compiled_code_and_keeps_its_accumulation_cycle():
    """A loaded step rebuilds what belongs to one process (CUDA graphs, compiled modules, streams).

    Planted fault: default pickling of a TrainStep copies its graphs and runner, which fails on CUDA
    (``CUDAGraph`` cannot be pickled); here a stand-in unpicklable object in ``graphs`` shows it.
    """
    torch.manual_seed(0)
    model = RootDropout()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    step = concur.train_step(model, nn.MSELoss(), optimizer, (x, y), streams=2, cuda_graph=False, accumulate=2)
    step(x, y)
    step.graphs[("planted",)] = threading.Lock()  # like a CUDAGraph: cannot be pickled
    buffer = io.BytesIO()
    torch.save(step, buffer)
    buffer.seek(0)
    resumed = torch.load(buffer, weights_only=False)
    assert not resumed.graphs and resumed.micro == step.micro == 1

"""train_step on CPU trains exactly like the plain loop (same plan, issue order)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchvision

import concur
from tests.amp_loop import amp_recipe_loop
from tests.models import DropoutBranches, WideNet


def plain_loop(model, loss_fn, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
], ids=["sgd_momentum", "adam", "adamw"])
def test_train_step_matches_plain_loop(make_opt):
    torch.manual_seed(0)
    model = WideNet(branches=6)
    ref = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(5)]
    with pytest.warns(UserWarning, match="no CUDA"):
        step = concur.train_step(model, loss_fn, make_opt(model.parameters()), batches[0], streams=4)
    losses = [step(x, y).item() for x, y in batches]
    expected = plain_loop(ref, loss_fn, make_opt(ref.parameters()), batches)
    assert losses == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for b, c in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_train_step_dropout_is_seeded_like_plain_loop():
    torch.manual_seed(0)
    model = DropoutBranches().train()
    ref = copy.deepcopy(model)
    loss_fn = lambda out, y: (out - y).square().mean()  # noqa: E731
    batches = [(torch.randn(4, 16), torch.randn(4, 16)) for _ in range(3)]
    step = concur.train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), batches[0],
                             cuda_graph=False)
    torch.manual_seed(5)
    losses = [step(x, y).item() for x, y in batches]
    torch.manual_seed(5)
    expected = plain_loop(ref, loss_fn, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    assert losses == pytest.approx(expected, rel=1e-6)


def test_train_step_googlenet_with_aux_outputs():
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False, dropout=0.0,
                                         dropout_aux=0.0)
    ref = copy.deepcopy(model)

    def loss_fn(out, y):
        ce = nn.functional.cross_entropy
        return ce(out.logits, y) + 0.3 * ce(out.aux_logits1, y) + 0.3 * ce(out.aux_logits2, y)

    batches = [(torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2,))) for _ in range(2)]
    step = concur.train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                             batches[0], streams=4, cuda_graph=False)
    losses = [step(x, y).item() for x, y in batches]
    expected = plain_loop(ref, loss_fn, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9), batches)
    assert losses == pytest.approx(expected, rel=1e-5)


def test_train_step_rejects_bad_arguments():
    model = WideNet(branches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="pair"):
        concur.train_step(model, nn.MSELoss(), opt, torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="streams"):
        concur.train_step(model, nn.MSELoss(), opt, (torch.randn(1, 3, 8, 8), torch.randn(1, 10)), streams=0)


def test_auto_streams_picks_a_count_from_the_predicted_curve():
    model = WideNet(branches=8)
    step = concur.train_step(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                             (torch.randn(2, 3, 8, 8), torch.randn(2, 10)), streams="auto", cuda_graph=False)
    assert step.requested_streams == "auto" and 2 <= step.module.plan.schedule.num_streams <= 4


def test_train_step_fp16_grad_scaler_matches_the_amp_recipe():
    """fp16 autocast + GradScaler: same losses, parameters and loss scale as PyTorch's AMP loop.

    The initial scale is large enough that the first steps overflow: those
    steps must be skipped and the scale backed off exactly as the plain loop
    does; the later steps train (checked: a scale so large that every step
    overflows would make any two runs equal).
    """
    torch.manual_seed(0)
    model = WideNet(branches=4)
    ref = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(6)]
    make_scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=2)  # noqa: E731
    initial = [p.detach().clone() for p in model.parameters()]
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731

    scaler = make_scaler()
    step = concur.train_step(model, loss_fn, make_opt(model.parameters()), batches[0], streams=4,
                             cuda_graph=False, amp_dtype=torch.float16, grad_scaler=scaler)
    losses = [step(x, y).item() for x, y in batches]

    ref_scaler = make_scaler()
    expected, skipped = amp_recipe_loop(ref, loss_fn, make_opt(ref.parameters()), batches, torch.float16, ref_scaler)
    assert 0 < skipped < len(batches), "the test needs both skipped and taken steps"
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial)), "no step trained"
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert losses == pytest.approx(expected, rel=1e-3)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=name)


def test_train_step_rejects_a_grad_scaler_of_the_wrong_type():
    model = WideNet(branches=2)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    with pytest.raises(TypeError, match="GradScaler"):
        concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                          batch, cuda_graph=False, grad_scaler=object())


def test_auto_streams_decide_in_the_plan_not_in_a_tuner(monkeypatch):
    """streams="auto" builds one module (one trace, or one compile) whose graphs choose among 2-4 streams and
    one: the tuner, which built and timed a step per stream count, is not called."""
    import concur.observe.tuner as tuner_mod

    monkeypatch.setattr(tuner_mod, "tune_train_step", lambda *a, **k: pytest.fail("the tuner ran"))
    model = WideNet(branches=2)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    step = concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), batch,
                             streams="auto", cuda_graph=False)
    assert list(step.modules) == ["auto"] and step.module._options["streams"] == "auto"
    compiled = concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                 streams="auto", cuda_graph=False, compile=True)
    assert compiled.backends["auto"].options.streams == "auto"


def test_compile_options_reach_the_backend_and_need_compile():
    model = WideNet(branches=2)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="compile=True"):
        concur.train_step(model, nn.CrossEntropyLoss(), opt, batch, cuda_graph=False,
                          compile_options={"buffer_reuse": False})
    step = concur.train_step(model, nn.CrossEntropyLoss(), opt, batch, streams=2, cuda_graph=False, compile=True,
                             compile_options={"buffer_reuse": False})
    assert step.backends[2].options.buffer_reuse is False


def test_snapshot_restores_the_loss_scale_even_if_warm_up_created_it():
    from concur.training.snapshot import Snapshot

    model = WideNet(branches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0)
    snapshot = Snapshot(model, opt, weights=True, grad_scaler=fresh)  # before the first scale(): no tensors yet
    fresh.scale(torch.ones(()))
    fresh.update(new_scale=8.0)
    snapshot.restore()
    assert fresh.get_scale() == 1024.0 and fresh._growth_tracker.item() == 0

    snapshot = Snapshot(model, opt, weights=True, grad_scaler=fresh)  # now with tensors: restored to the saved values
    fresh.update(new_scale=2.0)
    snapshot.restore()
    assert fresh.get_scale() == 1024.0


def test_sgd_adam_adamw_are_made_fused_for_the_device_side_skip_and_others_are_refused():
    from concur._torch_compat import enable_device_side_amp_skip

    params = [torch.nn.Parameter(torch.zeros(2))]
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = cls(params, lr=0.1)
        assert enable_device_side_amp_skip(opt)
        assert opt._step_supports_amp_scaling and all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    assert not enable_device_side_amp_skip(torch.optim.LBFGS(params))


def test_registration_hooks_live_only_while_a_step_needs_them():
    """torch's module-registration hooks are process-wide: the last step gone, they are removed."""
    import gc

    from concur.training.fingerprint import REGISTRATIONS

    gc.collect()
    before = REGISTRATIONS._watchers
    model = WideNet(branches=2)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    step = concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), batch,
                             streams=1, cuda_graph=False)
    assert REGISTRATIONS._watchers == before + 1 and REGISTRATIONS.hooked
    counted = REGISTRATIONS.count
    model.extra = nn.Linear(2, 2)
    assert REGISTRATIONS.count > counted
    del step
    gc.collect()
    assert REGISTRATIONS._watchers == before
    if before == 0:
        assert not REGISTRATIONS.hooked


def test_a_saved_step_keeps_its_format_and_arguments_by_name_and_loads_format_1():
    import pickle

    model = WideNet(branches=2)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    step = concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), batch,
                             streams=2, cuda_graph=False, accumulate=3)
    state = step.__getstate__()
    assert state["arguments"]["accumulate"] == 3 and state["arguments"]["streams"] == 2
    loaded = pickle.loads(pickle.dumps(step))
    assert loaded.accumulate == 3 and loaded.requested_streams == 2
    from concur.training.step import _ARGUMENTS, TrainStep

    assert state["format"] == 2
    old = TrainStep.__new__(TrainStep)  # format 1, with no format field: the arguments as a positional tuple
    old.__setstate__({"arguments": tuple(state["arguments"][name] for name in _ARGUMENTS), "micro": 1})
    assert old.accumulate == 3 and old.requested_streams == 2 and old.micro == 1
    with pytest.raises(ValueError, match="saved by a newer concur .format 3"):
        TrainStep.__new__(TrainStep).__setstate__({**state, "format": 3})


def test_the_unfused_plan_is_annotated_and_timed_in_the_steps_precision(monkeypatch):
    """With amp_dtype the fx path costs (and, on a GPU, times) its plan under the step's autocast: a plan judged in
    float32 serves a bfloat16 step with half its memory traffic, and its timing held twice the activations."""
    import concur.fx.module as fx_module

    seen = []
    real = fx_module.analyse

    def recording(model, inputs, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real(model, inputs, *args, **kwargs)

    monkeypatch.setattr(fx_module, "analyse", recording)
    torch.manual_seed(0)
    model = WideNet(branches=4)
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
    with pytest.warns(UserWarning, match="no CUDA"):
        step = concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                 streams=4, amp_dtype=torch.bfloat16)
    step(*batch)
    assert seen and all(s == (True, torch.bfloat16) for s in seen), seen

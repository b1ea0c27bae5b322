"""optimize(): drop-in equality with the original model, on synthetic and torchvision models."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

import concur
from concur.dag.hazards import build_dag
from tests.conftest import compare_with_original
from tests.models import SYNTHETIC, WideNet


@pytest.mark.parametrize("scheduler", ["serial", "critical_path", "fork"])
@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_models_match_original(name, scheduler):
    torch.manual_seed(0)
    cls, make_inputs = SYNTHETIC[name]
    compare_with_original(cls().train(), make_inputs, streams=4, scheduler=scheduler)


@pytest.mark.parametrize("name", ["inplace_hazard", "view_alias", "shared_bn", "dropout"])
def test_synthetic_models_match_in_eval_mode(name):
    cls, make_inputs = SYNTHETIC[name]
    compare_with_original(cls().eval(), make_inputs, streams=3, steps=1)


def test_wide_net_uses_many_streams():
    cm = compare_with_original(WideNet(branches=10), lambda: (torch.randn(2, 3, 8, 8),), streams=8)
    assert cm.schedule.num_streams >= 4
    streams = {cm.schedule.stream[n] for n in cm.schedule.order}
    assert len(streams) == cm.schedule.num_streams


TORCHVISION = {
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False), 64),
    # train mode with aux logits needs 299x299 (the aux head pools 17x17 features 5x5/3)
    "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False), 299),
    "inception_v3_noaux": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False), 75),
    "resnet50": (lambda: torchvision.models.resnet50(weights=None), 64),
}


@pytest.mark.parametrize("name", sorted(TORCHVISION))
def test_torchvision_models_match_original_in_train_mode(name):
    torch.manual_seed(0)
    make_model, size = TORCHVISION[name]
    compare_with_original(make_model().train(), lambda: (torch.randn(2, 3, size, size),), steps=1)


def test_inception_namedtuple_output_and_eval_plan():
    torch.manual_seed(0)
    model = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False).train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 299, 299)
    cm = concur.optimize(model, (x,), streams=4)
    out = cm(x)
    reference(x)  # same BatchNorm statistics update as cm(x)
    assert type(out).__name__ == "InceptionOutputs" and out.aux_logits is not None
    cm.eval()
    reference.eval()
    y = torch.randn(2, 3, 75, 75)
    with torch.no_grad():
        torch.testing.assert_close(cm(y), reference(y), rtol=1e-5, atol=1e-6)
    assert len(cm._plans) == 2, "eval mode must get its own plan (fx bakes `if self.training`)"


def test_parameters_are_the_same_objects_and_state_dict_keys_unchanged():
    model = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False)
    cm = concur.optimize(model, (torch.randn(1, 3, 64, 64),), streams=2)
    assert [id(p) for p in cm.parameters()] == [id(p) for p in model.parameters()]
    assert list(cm.state_dict()) == list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built on the original model
    before = model.fc.weight.detach().clone()
    cm(torch.randn(2, 3, 64, 64)).logits.sum().backward()
    opt.step()
    assert not torch.equal(before, model.fc.weight)


def test_optimize_leaves_model_state_untouched():
    model = SYNTHETIC["buffer_mutation"][0]()
    bn_model = torchvision.models.resnet18(weights=None).train()
    for m in (model, bn_model):
        buffers = {k: v.clone() for k, v in m.state_dict().items()}
        x = torch.randn(2, 3, 32, 32)
        x_copy = x.clone()
        rng = torch.random.get_rng_state()
        concur.optimize(m, (x,))
        for k, v in m.state_dict().items():
            assert torch.equal(v, buffers[k]), f"optimize changed {k}"
        assert torch.equal(x, x_copy)
        assert torch.equal(torch.random.get_rng_state(), rng)


def test_mutation_with_no_users_is_not_dropped():
    model = SYNTHETIC["buffer_mutation"][0]()
    cm = concur.optimize(model, (torch.randn(2, 3, 8, 8),))
    cm(torch.randn(2, 3, 8, 8))
    cm(torch.randn(2, 3, 8, 8))
    assert model.calls.item() == 2
    assert "add_" in cm.plan.code


def test_bad_inputs_give_clear_errors():
    model = WideNet(branches=2)
    with pytest.raises(TypeError, match="nn.Module"):
        concur.optimize(lambda x: x, (torch.randn(1),))
    with pytest.raises(TypeError, match="tuple"):
        concur.optimize(model, {"x": torch.randn(1)})
    with pytest.raises(ValueError, match="streams"):
        concur.optimize(model, (torch.randn(1, 3, 8, 8),), streams=0)
    with pytest.raises(ValueError, match="critical_path"):
        concur.optimize(model, (torch.randn(1, 3, 8, 8),), scheduler="fastest")
    with pytest.raises(ValueError, match="fallback"):
        concur.optimize(model, (torch.randn(1, 3, 8, 8),), fallback="maybe")


def test_single_tensor_example_is_accepted():
    model = WideNet(branches=2)
    cm = concur.optimize(model, torch.randn(1, 3, 8, 8), streams=2)
    assert cm(torch.randn(1, 3, 8, 8)).shape == (1, 10)


def test_generated_code_has_no_interpreter_loop():
    cm = concur.optimize(WideNet(branches=4), (torch.randn(1, 3, 8, 8),), streams=4)
    code = cm.plan.code
    for call in ("fork(", "switch(", "record(", "wait(", "join("):
        assert call in code
    assert "for " not in code
    ops = len(build_dag(cm.plan.traced.graph))
    assert ops == len(cm.schedule.order)


def test_inspect_reports_width_critical_path_and_speedups():
    info = concur.inspect(WideNet(branches=8), (torch.randn(2, 3, 16, 16),))
    assert info.width >= 8
    assert info.critical_path_us < info.serial_us
    assert set(info.predicted_speedup) == set(range(1, 9))
    assert info.predicted_speedup[1] == pytest.approx(1.0)
    assert info.predicted_speedup[8] > 2.0
    assert all(info.predicted_speedup[k] <= info.ideal_speedup[k] + 1e-9 for k in info.ideal_speedup)
    assert "critical path" in str(info)


def test_inspect_predicts_less_from_branches_whose_kernels_fill_the_device():
    """On an H100 roofline, 8 branches of big convolutions gain less than 8 of small ones."""
    from concur.dag.cost import ROOFLINES, AnalyticCost

    h100 = AnalyticCost(ROOFLINES["h100"])
    small = concur.inspect(WideNet(branches=8, channels=4), (torch.randn(1, 3, 8, 8),), cost_model=h100)
    big = concur.inspect(WideNet(branches=8, channels=64), (torch.randn(8, 3, 64, 64),), cost_model=h100)
    # without contention both look alike: the branches are equal, whatever their size
    assert big.ideal_speedup[8] > 0.8 * small.ideal_speedup[8]
    assert big.predicted_speedup[8] < 0.8 * small.predicted_speedup[8]
    assert big.predicted_speedup[8] < big.ideal_speedup[8]

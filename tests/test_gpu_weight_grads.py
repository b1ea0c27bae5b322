"""GPU tests of concur.fx.weight_grads (run on the device machine): weight gradients on their own stream.

- float64 gradients of an optimized branchy net equal the original model's, and the weights' gradients are
  accumulated on the plan's weight-gradient stream;
- under bf16 autocast the gradients equal the unsplit plan's, finite and in the parameters' dtype;
- the stream that called ``backward`` waits for that stream (a sleeping weight-gradient node, then the
  gradients read at once on the caller's stream);
- no race under PyTorch's CUDA sanitizer, which does report one planted on purpose;
- ``train_step`` (whole-step CUDA graphs, high-priority capture) trains like the plain loop in float64.

    python -m pytest -q -m cuda tests/test_gpu_weight_grads.py
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import concur  # noqa: E402
from concur.fx import weight_grads  # noqa: E402
from tests.conftest import assert_close_rel, requires_cuda  # noqa: E402
from tests.models import WideNet  # noqa: E402
from tests.test_gpu import exact_math  # noqa: E402,F401 - exact_math is an autouse fixture

pytestmark = [pytest.mark.cuda, requires_cuda]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLITS = 14  # WideNet(branches=6): 13 convolutions and the head


def weighted_sum(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype, device=out.device).view_as(out)).sum()


def _pair():
    torch.manual_seed(0)
    model = WideNet(branches=6).cuda().double().train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 3, 16, 16, device="cuda", dtype=torch.float64)
    # the prediction decides (4 streams): these tests check the weight-gradient stream's synchronization, which a
    # timing beside other processes on the GPU (the cuda tier runs its files side by side) may drop to one stream
    optimized = concur.optimize(model, (x,), streams=4, split_weight_grads=True, measure=False)
    assert optimized.schedule.num_streams > 1 and optimized.plan.weight_grad_splits == SPLITS
    return optimized, model, reference


def test_float64_gradients_equal_the_original_and_accumulate_on_the_weight_gradient_stream():
    optimized, model, reference = _pair()
    seen = []
    model.towers[2][1][0].weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(torch.cuda.current_stream()))
    for step in range(2):  # the second reuses the memory the first freed
        x = torch.randn(8, 3, 16, 16, device="cuda", dtype=torch.float64)
        inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        outs = [optimized(inputs[0]), reference(inputs[1])]
        for out in outs:
            weighted_sum(out).backward()
        assert_close_rel(outs[0], outs[1], 1e-12, f"step {step} output")
        assert_close_rel(inputs[0].grad, inputs[1].grad, 1e-10, f"step {step} input grad")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_close_rel(p.grad, q.grad, 1e-10, f"step {step} {name}")
    weight_stream = optimized.plan.runtime._weight_grad
    assert weight_stream is not None and weight_stream.priority == 0
    assert seen == [weight_stream, weight_stream]


def test_the_caller_waits_for_the_weight_gradient_stream(monkeypatch):
    """Each weight-gradient node sleeps ~10 ms on its stream first: read at once, the gradients must be done."""
    real = weight_grads._WeightGrad.backward

    def sleepy(ctx, grad):
        torch.cuda._sleep(20_000_000)
        return real(ctx, grad)

    monkeypatch.setattr(weight_grads._WeightGrad, "backward", staticmethod(sleepy))
    optimized, model, reference = _pair()
    x = torch.randn(8, 3, 16, 16, device="cuda", dtype=torch.float64)
    weighted_sum(optimized(x)).backward()
    got = [p.grad.clone() for p in model.parameters()]  # on the caller's stream, no synchronize
    weighted_sum(reference(x)).backward()
    for (name, _), g, q in zip(model.named_parameters(), got, reference.parameters()):
        assert_close_rel(g, q.grad, 1e-10, name)


def test_bf16_autocast_gradients_equal_the_unsplit_plan_and_keep_the_parameters_dtype():
    """Under autocast the weight gradient runs on a cast input and a stand-in weight (its values never read)."""
    torch.manual_seed(0)
    models = [WideNet(branches=6).cuda().train() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(8, 3, 16, 16, device="cuda")
    split, unsplit = (concur.optimize(m, (x,), streams=4, split_weight_grads=s) for m, s in zip(models, (True, False)))
    assert split.plan.weight_grad_splits == SPLITS and unsplit.schedule == split.schedule
    for module in (split, unsplit):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module(x)
        weighted_sum(out.float()).backward()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
        assert_close_rel(p.grad, q.grad, 1e-2, name)


def _sanitized(*flags):
    return subprocess.run([sys.executable, "-m", "tests.test_gpu_weight_grads", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_sanitizer_reports_no_race_with_split_weight_gradients():
    run = _sanitized()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "CSAN" not in run.stderr and "weight-gradient run finished" in run.stdout


def test_sanitizer_reports_a_weight_gradient_read_on_an_unsynchronized_stream():
    run = _sanitized("--plant-unsynchronized-stream")
    assert run.returncode != 0 and "CSAN" in (run.stdout + run.stderr)


def test_train_step_with_split_weight_gradients_equals_the_plain_loop_in_float64():
    torch.manual_seed(0)
    model = WideNet(branches=6).cuda().double().train()
    ref = copy.deepcopy(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, device="cuda", dtype=torch.float64, generator=g),
                torch.randint(0, 10, (4,), device="cuda", generator=g)) for _ in range(8)]
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    step = concur.train_step(model, nn.functional.cross_entropy, make_opt(model), batches[0], streams=4)
    losses = torch.tensor([step(x, y).item() for x, y in batches], dtype=torch.float64)
    assert step.graphs and all(c.streams == 4 for c in step.graphs.values())
    assert step.module.plan.weight_grad_splits == SPLITS
    opt = make_opt(ref)
    expected = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    expected = torch.tensor(expected, dtype=torch.float64)
    deviation = ((losses - expected).abs() / expected.abs()).max().item()
    print(f"train_step with split weight gradients: loss deviation {deviation:.2e}")
    assert deviation <= 1e-9
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9, msg=name)


def _sanitized_run(plant: bool) -> None:
    """Train steps and gradient calls under CSAN; exits non-zero (CSAN raises) on a race."""
    import torchvision

    from concur._torch_compat import cuda_sanitizer

    if plant:  # the planted bug: the weight gradient read on a stream that never waited for it
        real = weight_grads._WeightGrad.backward

        def unsynchronized(ctx, grad):
            with torch.cuda.stream(torch.cuda.Stream()):
                return real(ctx, grad)

        weight_grads._WeightGrad.backward = staticmethod(unsynchronized)
    os.environ.setdefault("CONCUR_MEASURE", "0")  # check the 4-stream plan, not whichever a timing under CSAN keeps
    with cuda_sanitizer():
        torch.manual_seed(0)
        model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).cuda().train()
        x = torch.randn(4, 3, 64, 64, device="cuda")
        y = torch.randint(0, 1000, (4,), device="cuda")
        step = concur.train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01,
                                 momentum=0.9), (x, y), streams=4, cuda_graph=False,
                                 split_weight_grads=True)
        splits = step.module.plan.weight_grad_splits
        assert splits > 0, "the plan must split weight gradients"
        for _ in range(2):
            loss = step(torch.randn_like(x), y)
        out = step.module(torch.randn_like(x))  # gradients of weights only, then accumulation
        grads = torch.autograd.grad(out.float().sum(), [model.conv1.conv.weight, model.fc.weight])
        step.module(torch.randn_like(x)).sum().backward()
        step.module(torch.randn_like(x)).sum().backward()
        torch.cuda.synchronize()
    print(f"sanitized weight-gradient run finished, loss {loss.item():.4f}, {splits} layers split, "
          f"gradient norms {[round(g.norm().item(), 4) for g in grads]}")


if __name__ == "__main__":
    _sanitized_run("--plant-unsynchronized-stream" in sys.argv)

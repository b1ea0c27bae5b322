"""GPU tests of training habits through train_step's whole-step CUDA graphs (4 streams), against the plain loop.

Schedules (OneCycleLR cycling SGD's momentum and AdamW's beta1), gradient
clipping in ``before_step``, accumulation over 2, freezing a block half-way
and a block's BatchNorm set to eval half-way. Two models:

- a small branchy net in float64 for 24 steps, where the graph must equal
  the plain loop to 1e-9 (only summation order differs);
- GoogLeNet in fp32 for 20 steps, within the plain loop's own envelope (the
  same loop from parameters nudged by 1e-6, as in tests/test_gpu.py).

Each scenario fails without the behaviour it checks: a float learning rate,
momentum or betas baked into the graph at capture (the OneCycleLR scenarios
would keep the first values), no ``before_step`` or ``accumulate``
(TypeError), or a graph key of input shapes only (a frozen block would keep
training, a BatchNorm set to eval would keep using batch statistics). Run on a GPU:

    python -m pytest -q -m cuda tests/test_gpu_train_habits.py
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torchvision  # noqa: E402

import concur  # noqa: E402
from tests.conftest import requires_cuda  # noqa: E402
from tests.envelope import assert_within_envelope, perturbed  # noqa: E402
from tests.test_gpu import _loss, exact_math  # noqa: E402,F401 - exact_math is an autouse fixture
from tests.models import WideNet  # noqa: E402

pytestmark = [pytest.mark.cuda, requires_cuda]


def _clip(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


class Scenario:
    """One habit: optimizer, scheduler, accumulation, before_step, and changes applied before a given call."""

    def __init__(self, make_opt, make_sched=None, k=1, before_step=None, events=None):
        self.make_opt, self.make_sched, self.k, self.before_step = make_opt, make_sched, k, before_step
        self.events = events or {}


def _sgd(lr):
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)


def _adamw(lr):
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01)


def _onecycle(max_lr, steps):
    return lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=max_lr, total_steps=steps)


def scenarios(steps, sgd_lr, adam_lr, freeze, bn_eval):
    half = steps // 2
    return {
        "onecycle_sgd_momentum": Scenario(_sgd(sgd_lr), _onecycle(10 * sgd_lr, steps)),
        "onecycle_adamw": Scenario(_adamw(adam_lr), _onecycle(10 * adam_lr, steps)),
        "clip_grad_norm": Scenario(_sgd(sgd_lr), before_step=_clip),
        "accumulate_2": Scenario(_sgd(sgd_lr), k=2),
        "freeze_half_way": Scenario(_adamw(adam_lr), events={half: lambda m: freeze(m).requires_grad_(False)}),
        "bn_eval_half_way": Scenario(_sgd(sgd_lr), events={half: lambda m: bn_eval(m).eval()}),
    }


def plain_loop(model, sc, batches):
    """PyTorch's recipe with the scenario's habits."""
    opt = sc.make_opt(model)
    sched = sc.make_sched(opt) if sc.make_sched else None
    losses = []
    for i, (x, y) in enumerate(batches):
        if i in sc.events:
            sc.events[i](model)
        if i % sc.k == 0:
            opt.zero_grad(set_to_none=True)
        loss = _loss(model(x), y)
        (loss / sc.k if sc.k > 1 else loss).backward()
        if i % sc.k == sc.k - 1:
            if sc.before_step:
                sc.before_step(model, opt)
            opt.step()
            if sched:
                sched.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def concur_loop(model, sc, batches):
    opt = sc.make_opt(model)
    sched = sc.make_sched(opt) if sc.make_sched else None
    step = concur.train_step(model, _loss, opt, batches[0], streams=4, accumulate=sc.k, before_step=sc.before_step)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i in sc.events:
            sc.events[i](model)
        losses.append(step(x, y).item())
        if sched and i % sc.k == sc.k - 1:
            sched.step()
    return torch.tensor(losses, dtype=torch.float64), step


def _check_graphs(step, name, sc):
    assert step.graphs, "the step must run as captured graphs"
    assert all(c.streams == 4 for c in step.graphs.values()), "the 4-stream graphs must be used"
    assert step._hyper is not None, "SGD/AdamW hyperparameters must be read from device tensors"
    expected = 2 if sc.k == 2 or sc.events else 1  # cycle positions, or the state before and after the change
    assert len(step.graphs) == expected, f"{name}: {len(step.graphs)} graphs, expected {expected}"


BRANCHY_STEPS = 24
BRANCHY = scenarios(BRANCHY_STEPS, 0.05, 1e-3, freeze=lambda m: m.towers[0], bn_eval=lambda m: m.towers[1])


@pytest.mark.parametrize("name", sorted(BRANCHY))
def test_branchy_float64_habits_equal_the_plain_loop(name):
    sc = BRANCHY[name]
    torch.manual_seed(0)
    model = WideNet(branches=6).cuda().double().train()
    ref = copy.deepcopy(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, device="cuda", dtype=torch.float64, generator=g),
                torch.randint(0, 10, (4,), device="cuda", generator=g)) for _ in range(BRANCHY_STEPS)]
    losses, step = concur_loop(model, sc, batches)
    expected = plain_loop(ref, sc, batches)
    _check_graphs(step, name, sc)
    deviation = ((losses - expected).abs() / expected.abs()).max().item()
    param_dev = max(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
                    for p, q in zip(model.parameters(), ref.parameters()))
    print(f"branchy float64 {name}: loss deviation {deviation:.2e}, parameter deviation {param_dev:.2e}")
    assert deviation <= 1e-9 and param_dev <= 1e-9
    for b, c in zip(model.buffers(), ref.buffers()):
        assert (b.double() - c.double()).abs().max() <= 1e-9 * max(1.0, c.double().abs().max().item())


GOOGLENET_STEPS = 20
GOOGLENET = scenarios(GOOGLENET_STEPS, 1e-3, 1e-4, freeze=lambda m: m.inception3a,
                      bn_eval=lambda m: m.inception4b)


@pytest.mark.parametrize("name", sorted(GOOGLENET))
def test_googlenet_fp32_habits_within_the_plain_loops_envelope(name):
    sc = GOOGLENET[name]
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False,
                                         dropout=0.0).cuda().train()
    ref, twin = copy.deepcopy(model), perturbed(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(8, 3, 64, 64, device="cuda", generator=g),
                torch.randint(0, 1000, (8,), device="cuda", generator=g)) for _ in range(GOOGLENET_STEPS)]
    losses, step = concur_loop(model, sc, batches)
    _check_graphs(step, name, sc)
    expected, envelope = plain_loop(ref, sc, batches), plain_loop(twin, sc, batches)
    assert_within_envelope(f"googlenet fp32 {name}", losses, expected, envelope, model, ref, twin)


def test_a_saved_graph_step_resumes_the_same_run_in_float64():
    """``torch.save`` of a step that holds CUDA graphs; the loaded step captures again and continues the run.

    Fails before ``TrainStep.__getstate__`` (default pickling reaches the ``CUDAGraph`` objects).
    """
    torch.manual_seed(0)
    model = WideNet(branches=4).cuda().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(4, 3, 16, 16, device="cuda", dtype=torch.float64, generator=g),
                torch.randint(0, 10, (4,), device="cuda", generator=g)) for _ in range(6)]
    step = concur.train_step(model, nn.functional.cross_entropy, opt, batches[0], streams=4)
    for x, y in batches[:3]:
        step(x, y)
    assert step.graphs, "the step must hold captured graphs before the save"
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "concur_saved_step.pt")
    torch.save(step, path)
    resumed = torch.load(path, weights_only=False)
    expected = [step(x, y).item() for x, y in batches[3:]]
    got = [resumed(x, y).item() for x, y in batches[3:]]
    assert resumed.graphs, "the loaded step must capture graphs of its own"
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-9, (got, expected)
    for p, q in zip(step.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-9)


@pytest.mark.parametrize("compile", [False, True])
def test_high_priority_capture_trains_as_the_plain_loop_in_float64(compile):
    """``stream_priority=True``: captured on a high-priority stream; with compile, weight gradients split."""
    torch.manual_seed(0)
    model = WideNet(branches=6).cuda().double().train()
    ref = copy.deepcopy(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, device="cuda", dtype=torch.float64, generator=g),
                torch.randint(0, 10, (4,), device="cuda", generator=g)) for _ in range(12)]
    sc = Scenario(_sgd(0.05))
    opt = sc.make_opt(model)
    # the split program on streams is what is checked, so no timing may drop it for inductor's own
    step = concur.train_step(model, _loss, opt, batches[0], streams=4, stream_priority=True, compile=compile,
                             **({"compile_options": {"measure": False}} if compile else {}))
    losses = torch.tensor([step(x, y).item() for x, y in batches], dtype=torch.float64)
    expected = plain_loop(ref, sc, batches)
    least, greatest = torch.cuda.Stream.priority_range()
    assert step._runner.stream.priority == greatest < least
    if compile:
        backward = [gr for gr in step.backends[4].graphs if gr.is_backward]
        # the split is made in the program put on streams, and only there
        assert backward and all((gr.convolutions_split > 0) == (gr.num_streams > 1) for gr in backward), backward
    deviation = ((losses - expected).abs() / expected.abs()).max().item()
    print(f"priority compile={compile}: loss deviation {deviation:.2e}")
    assert deviation <= 1e-9

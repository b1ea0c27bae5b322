"""GPU tests (run on the device machine): equality with 4 streams, CSAN, sleep-proven waits, training."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torchvision  # noqa: E402

import concur  # noqa: E402
from concur.streams import StreamRuntime  # noqa: E402
from tests.amp_loop import amp_recipe_loop  # noqa: E402
from tests.conftest import requires_cuda  # noqa: E402
from tests.envelope import assert_within_envelope, perturbed  # noqa: E402

pytestmark = [pytest.mark.cuda, requires_cuda]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def exact_math():
    flags = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
     torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) = flags


MODELS = {
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False,
                                                        dropout=0.0, dropout_aux=0.0), 224, 8),
    "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False,
                                                              dropout=0.0), 299, 8),
    "resnet50": (lambda: torchvision.models.resnet50(weights=None), 224, 8),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_matches_original_with_4_streams(name):
    """Outputs to 1e-5, and gradients as close to float64's as the unmodified model's own.

    The plan issues branches in another order, so autograd sums branch
    gradients in another order, and BatchNorm's backward amplifies that where
    its terms cancel: the 4-stream gradients may differ from the unmodified
    model's by 1e-3 at most (Inception-v3: 2e-4 over all gradients). The
    oracle is the unmodified model in float64: the 4-stream gradients must be
    no farther from it than the float32 model's own (within 10%). One stream
    runs the model's own order (:func:`concur.dag.decide.schedule_graph`), so
    its gradients are the unmodified model's.
    """
    make, size, batch = MODELS[name]
    torch.manual_seed(0)
    model = make().train().cuda()
    copies = [copy.deepcopy(model) for _ in range(4)]
    x = torch.randn(batch, 3, size, size, device="cuda")
    # measure=False: this checks the 4-stream plan's numerics, whichever plan a timing would keep
    ref, exact = copies[0], copies[3].double()
    one = concur.optimize(copies[1], (x,), streams=1)
    four = concur.optimize(copies[2], (x,), streams=4, measure=False)
    assert four.schedule.num_streams > 1
    grads, outs = [], []
    for m, inp in ((ref, x), (one, x), (four, x), (exact, x.double())):
        out = m(inp)
        logits = out[0] if isinstance(out, tuple) else out
        weights = torch.linspace(0.5, 1.5, logits.numel(), device="cuda", dtype=logits.dtype).view_as(logits)
        (logits * weights).sum().backward()
        outs.append(logits.detach().double())
        grads.append(torch.cat([p.grad.double().flatten() for p in m.parameters() if p.grad is not None]))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(outs[2], outs[0]) < 1e-5
    e_ref, e1, e4 = (rel(grads[i], grads[3]) for i in range(3))
    print(f"{name}: gradient rel. error against float64: model {e_ref:.2e}, 1 stream {e1:.2e}, 4 streams {e4:.2e}")
    assert rel(grads[1], grads[0]) <= 1e-5, "one stream runs the model's own order: its gradients are the model's"
    assert rel(grads[2], grads[0]) <= 1e-3, f"4 streams {rel(grads[2], grads[0]):.2e} from the unmodified model"
    assert e4 <= 1.1 * e_ref + 1e-6, f"4 streams {e4:.2e} from float64, the unmodified model {e_ref:.2e}"


def _sanitized(*flags):
    return subprocess.run([sys.executable, "-m", "tests.gpu_sanitized_run", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("model", ["googlenet", "inception_v3", "resnet50"])
def test_sanitizer_reports_no_race(model):
    run = _sanitized("--model", model)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "CSAN" not in run.stderr


def test_sanitizer_reports_a_planted_missing_wait():
    run = _sanitized("--plant-missing-wait")
    assert run.returncode != 0 and "CSAN" in (run.stdout + run.stderr)


class Sleepy(nn.Module):
    """Doubles its input after keeping its stream busy for ~50 ms."""

    def forward(self, x):
        torch.cuda._sleep(100_000_000)
        return x * 2.0


class TwoSlowBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left, self.right = Sleepy(), Sleepy()

    def forward(self, x):
        s = self.stem(x)
        return self.left(s + 1.0) - self.right(s - 1.0)


@pytest.mark.parametrize("planted", [False, True], ids=["waits", "waits_removed"])
def test_sleeping_branch_shows_the_waits_are_real(planted, monkeypatch):
    model = TwoSlowBranches().cuda()
    x = torch.randn(2, 3, 16, 16, device="cuda")
    cm = concur.optimize(model, (x,), streams=2, scheduler="fork", leaf_modules=[Sleepy])
    assert cm.schedule.num_streams == 2
    if planted:
        monkeypatch.setattr(StreamRuntime, "wait", lambda self, event: None)
    mismatches = 0
    for _ in range(3):
        x = torch.randn(2, 3, 16, 16, device="cuda")
        with torch.no_grad():
            got = cm(x)
            expected = model(x)
        mismatches += not torch.allclose(got, expected)
    # a removed wait is a race: whether an iteration loses it depends on what else the GPU is running
    assert mismatches >= 1 if planted else mismatches == 0


def _train(model, opt, batches, step=None):
    losses = []
    for x, y in batches:
        if step is not None:
            losses.append(step(x, y).item())
            continue
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = _loss(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _loss(out, y):
    ce = nn.functional.cross_entropy
    if isinstance(out, tuple):
        aux = [a for a in out[1:] if a is not None]
        return ce(out[0], y) + sum(0.3 * ce(a, y) for a in aux)
    return ce(out, y)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_train_step_graph_with_4_streams_matches_eager_for_50_steps(name, optimizer):
    """50 replays of the 4-stream whole-step graph against the plain eager loop.

    The first step must agree to 1e-5. Later, fp32 differences compound
    through training, so the tolerance is the envelope of the eager loop
    itself: the same loop started from parameters perturbed by 1e-6 relative.
    concur must stay within 4x that envelope (plus 1e-4).
    """
    make, size, batch = MODELS[name]
    if optimizer == "adam" and name != "googlenet":
        pytest.skip("Adam is checked on GoogLeNet only, to keep the GPU suite short")
    torch.manual_seed(0)
    model = make().cuda().train()
    ref, twin = copy.deepcopy(model), perturbed(model)
    make_opt = (lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)) if optimizer == "sgd" else \
        (lambda p: torch.optim.Adam(p, lr=1e-4))
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(batch, 3, size, size, device="cuda", generator=g),
                torch.randint(0, 1000, (batch,), device="cuda", generator=g)) for _ in range(50)]
    opt = make_opt(model.parameters())
    step = concur.train_step(model, _loss, opt, batches[0], streams=4, cuda_graph=True)
    losses = torch.tensor(_train(model, opt, batches, step))
    assert step.graphs and next(iter(step.graphs.values())).streams == 4, "the 4-stream graph must be used"
    expected = torch.tensor(_train(ref, make_opt(ref.parameters()), batches))
    envelope = torch.tensor(_train(twin, make_opt(twin.parameters()), batches))
    assert_within_envelope(f"{name}/{optimizer}", losses, expected, envelope, model, ref, twin)


def test_train_step_smaller_last_batch_gets_its_own_graph():
    make, size, _ = MODELS["googlenet"]
    torch.manual_seed(0)
    model = make().cuda().train()
    ref, twin = copy.deepcopy(model), perturbed(model)
    batches = [(torch.randn(n, 3, 64, 64, device="cuda"), torch.randint(0, 1000, (n,), device="cuda"))
               for n in (8, 8, 3, 8, 8, 3)]
    make_opt = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    opt = make_opt(model.parameters())
    step = concur.train_step(model, _loss, opt, batches[0], streams=4)
    losses = torch.tensor(_train(model, opt, batches, step))
    expected = torch.tensor(_train(ref, make_opt(ref.parameters()), batches))
    envelope = torch.tensor(_train(twin, make_opt(twin.parameters()), batches))
    assert len(step.graphs) == 2 and all(c.streams == 4 for c in step.graphs.values())
    deviation = (losses - expected).abs() / expected.abs()
    allowed = 4 * ((envelope - expected).abs() / expected.abs()).cummax(0).values + 1e-4
    print(f"mixed batch sizes: deviation {deviation.tolist()}, allowed {allowed.tolist()}")
    assert deviation[0] < 1e-5 and (deviation <= allowed).all()


def _run_trial(name: str, calls: int) -> concur.TrainStep:
    """GoogLeNet unfused on 4 streams for ``calls`` steps, nothing cached; the run within the eager loop's
    envelope, and one private pool left (no empty_cache here: a run calls none later, and one would hide a pool
    the step kept alive until then). Returns the step."""
    make, size, batch = MODELS["googlenet"]
    torch.manual_seed(0)
    model = make().cuda().train()
    ref, twin = copy.deepcopy(model), perturbed(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(batch, 3, size, size, device="cuda", generator=g),
                torch.randint(0, 1000, (batch,), device="cuda", generator=g)) for _ in range(calls)]
    make_opt = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    opt = make_opt(model.parameters())
    step = concur.train_step(model, _loss, opt, batches[0], streams=4)
    losses = torch.tensor(_train(model, opt, batches, step))
    (decision,) = step.step_decisions
    print(f"{name}: {decision.reason}")
    assert not step.deciding and len(step.graphs) == 1
    pools = {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()
             if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)}
    assert len(pools) == 1, f"private pools held after the trial: {sorted(pools)}"
    expected = torch.tensor(_train(ref, make_opt(ref.parameters()), batches))
    envelope = torch.tensor(_train(twin, make_opt(twin.parameters()), batches))
    assert_within_envelope(f"googlenet/{name}", losses, expected, envelope, model, ref, twin)
    return step


def test_train_step_times_its_programs_on_its_first_calls(tmp_path, monkeypatch):
    """Unfused on CUDA, nothing cached: the first calls replay each program in turn, timed; then one graph stays,
    the trial's pool given back when the kept program was captured again.

    Every call is a real step, whichever program it replays: the run stays
    within the eager loop's envelope throughout.
    """
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    (decision,) = _run_trial("trial", 40).step_decisions
    assert decision.source == "measurement" and decision.measured.rounds >= 3


def test_train_step_times_its_programs_one_at_a_time_where_together_they_do_not_fit(tmp_path, monkeypatch):
    """Every program at once runs out of memory (faked at the trial's capture): the plan is captured alone and
    timed, then freed and the one-stream program captured in a new pool and timed; the faster stays, the run
    within the eager loop's envelope, and one private pool is left."""
    import concur.training.capture as capture_mod
    from concur.training.trial import ROUNDS as trial_rounds

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (faked)")

    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(capture_mod, "capture_trial", out_of_memory)
    (decision,) = _run_trial("one at a time", 24).step_decisions
    assert decision.source == "measurement" and decision.measured.rounds == trial_rounds


def _googlenet_with_dropout(p=0.5):
    return torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False, dropout=p)


def test_train_step_dropout_same_seed_gives_the_same_run():
    """Dropout inside the captured graph: masks follow the seed, as in the plain loop.

    Warm-up draws masks too; the snapshot restores the generator, so the first
    replay draws the masks the user's first eager step would have drawn.
    """
    torch.manual_seed(0)
    model = _googlenet_with_dropout().cuda().train()
    ref, twin = copy.deepcopy(model), perturbed(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(8, 3, 64, 64, device="cuda", generator=g),
                torch.randint(0, 1000, (8,), device="cuda", generator=g)) for _ in range(10)]
    make_opt = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    runs = []
    for m in (model, copy.deepcopy(ref)):
        opt = make_opt(m.parameters())
        torch.manual_seed(5)
        step = concur.train_step(m, _loss, opt, batches[0], streams=4)
        runs.append(torch.tensor(_train(m, opt, batches, step)))
    torch.manual_seed(5)
    expected = torch.tensor(_train(ref, make_opt(ref.parameters()), batches))
    torch.manual_seed(5)
    envelope = torch.tensor(_train(twin, make_opt(twin.parameters()), batches))
    assert torch.equal(runs[0], runs[1]), "the same seed must give the same run"
    deviation = (runs[0] - expected).abs() / expected.abs()
    allowed = 4 * ((envelope - expected).abs() / expected.abs()).cummax(0).values + 1e-4
    print(f"dropout: deviation {deviation.max():.2e}, allowed {allowed.max():.2e}")
    assert deviation[0] < 1e-5 and (deviation <= allowed).all()


def _mixed_precision_setup():
    """Channels-last GoogLeNet, its copy, a twin perturbed by 1e-3 (the envelope) and 20 batches."""
    torch.manual_seed(0)
    model = _googlenet_with_dropout(0.0).cuda().train().to(memory_format=torch.channels_last)
    ref, twin = copy.deepcopy(model), perturbed(model, rel=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(8, 3, 64, 64, device="cuda", generator=g).to(memory_format=torch.channels_last),
                torch.randint(0, 1000, (8,), device="cuda", generator=g)) for _ in range(20)]
    return model, ref, twin, batches


def test_train_step_bf16_autocast_matches_the_autocast_loop():
    model, ref, twin, batches = _mixed_precision_setup()
    make_opt = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731

    def autocast_loop(m):
        return torch.tensor(amp_recipe_loop(m, _loss, make_opt(m.parameters()), batches, torch.bfloat16)[0])

    opt = make_opt(model.parameters())
    step = concur.train_step(model, _loss, opt, batches[0], streams=4, amp_dtype=torch.bfloat16)
    losses = torch.tensor(_train(model, opt, batches, step))
    assert next(iter(step.graphs.values())).streams == 4
    expected, envelope = autocast_loop(ref), autocast_loop(twin)
    deviation = (losses - expected).abs() / expected.abs()
    allowed = 4 * ((envelope - expected).abs() / expected.abs()).cummax(0).values + 1e-2
    print(f"bf16: deviation {deviation.max():.2e}, allowed {allowed.max():.2e}")
    assert (deviation <= allowed).all()


def test_train_step_fp16_grad_scaler_in_the_graph_matches_the_amp_recipe():
    """fp16 autocast + GradScaler inside the captured step, against PyTorch's AMP loop.

    The scale grows every 4 good steps until a step overflows: the graph must
    skip those steps on the device and back the scale off exactly as the plain
    loop does (same final scale), and train within the loop's own fp16
    envelope in between. The scale starts at 2**16: from 2**40 all 20 steps
    would overflow and nothing would train, so the test could not fail on training.
    """
    model, ref, twin, batches = _mixed_precision_setup()
    make_opt = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    make_scaler = lambda: torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, growth_interval=4)  # noqa: E731
    initial = [p.detach().clone() for p in model.parameters()]

    def amp_loop(m):
        scaler = make_scaler()
        losses, skipped = amp_recipe_loop(m, _loss, make_opt(m.parameters()), batches, torch.float16, scaler)
        assert 0 < skipped < len(batches), f"the test needs skipped and taken steps, got {skipped} skipped"
        return torch.tensor(losses), scaler.get_scale()

    opt, scaler = make_opt(model.parameters()), make_scaler()
    step = concur.train_step(model, _loss, opt, batches[0], streams=4, amp_dtype=torch.float16,
                             grad_scaler=scaler)
    losses = torch.tensor(_train(model, opt, batches, step))
    assert next(iter(step.graphs.values())).streams == 4, "the 4-stream graph must be used"
    (expected, expected_scale), (envelope, _) = amp_loop(ref), amp_loop(twin)
    assert scaler.get_scale() == expected_scale
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial)), "no step trained"
    deviation = (losses - expected).abs() / expected.abs()
    allowed = 4 * ((envelope - expected).abs() / expected.abs()).cummax(0).values + 1e-2
    print(f"fp16+GradScaler: deviation {deviation.max():.2e}, allowed {allowed.max():.2e}, "
          f"scale {scaler.get_scale():.0f}")
    assert (deviation <= allowed).all()


def test_auto_streams_with_compile_times_every_stream_count_of_one_compile(monkeypatch, tmp_path):
    """streams="auto" with compile=True: each graph times its plans on 2-4 streams and inductor's own call in one
    set of rounds, from one compile, and keeps none slower than one stream."""
    import concur.dag.decide as decide_mod
    from tests.models import WideNet

    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path))  # measure here, not a cached result
    decisions = []
    real = decide_mod.choose
    monkeypatch.setattr(decide_mod, "choose", lambda *a, **k: decisions.append(real(*a, **k)) or decisions[-1])
    torch.manual_seed(0)
    model = WideNet(branches=4).cuda()
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = concur.train_step(model, nn.CrossEntropyLoss(), opt, (x, y), streams="auto", compile=True)
    assert torch.isfinite(step(x, y))
    graphs = step.backends["auto"].graphs
    timed = [d for d in decisions if d.measured is not None]
    print("auto with compile:", [(d.num_streams, round(d.measured.one_stream_ms, 3), d.measured.candidates_ms)
                                 for d in timed], [(g.num_streams, g.decided_by) for g in graphs])
    assert len(graphs) == 2 and timed, (graphs, decisions)
    assert any(d.measured.candidates_ms for d in timed)  # several stream counts timed in one decision
    for d in timed:
        assert not d.keep or d.measured.streams_ms < d.measured.one_stream_ms

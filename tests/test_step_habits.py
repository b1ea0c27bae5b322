"""Training habits through train_step, against the plain PyTorch loop, in float64 on CPU (differences <= 1e-9).

Schedulers, gradient clipping, gradient accumulation, and changes between
calls (BatchNorm to eval, freezing, new param groups, loading state,
replacing a submodule). On CPU the step runs eagerly, which would hide what
a CUDA graph cannot see; so each habit also runs through the graph path with
:class:`EmulatedGraphs`, which replays the captured body with the Python
state of its capture (train/eval flags, requires_grad, the param groups'
values), as a real graph does. Tests named ``test_planted_*`` plant a fault
in concur and check that the comparison catches it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings

import pytest
import torch
import torch.nn as nn

import concur
import concur.training.capture as capture_mod
import concur.training.captured_optim as captured_optim
import concur.training.step as train_mod
from concur.training.snapshot import Snapshot
from tests.amp_loop import MovedStateScaler, amp_recipe_loop

TOL = 1e-9


class Branchy(nn.Module):
    """Two towers (one with BatchNorm) on a shared stem, concatenated."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.a = nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU())  # a bias before BN
        # would have a zero gradient up to rounding, which Adam magnifies to ~1e-9
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.head(torch.cat([self.a(h), self.b(h)], dim=1))


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def make_batches(n=10, size=5, last=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    sizes = [size] * n if last is None else [size] * (n - 1) + [last]
    return [(torch.randn(s, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (s,), generator=g))
            for s in sizes]


def make_model(seed=0):
    torch.manual_seed(seed)
    return Branchy().double()


class _Replay:
    """Reruns the captured body with the Python state of its capture and writes what it returns (the loss and
    the gradients) into the tensors its capture returned, as a graph writes its static outputs."""

    def __init__(self, body, out, step, frozen):
        self.body, self.out, self.step, self.frozen = body, out, step, frozen
        self.replays = 0

    def replay(self):
        now = python_state(self.step)
        apply_state(self.frozen)
        try:
            with self.step._runner.watch():  # what the graph holds: the body's ops, not the emulation's copies
                loss, grads = self.body()
        finally:
            apply_state(now)
        static_loss, static_grads = self.out
        static_loss.copy_(loss)
        assert static_grads.keys() == grads.keys()
        for p, g in grads.items():
            if g is not static_grads[p]:
                static_grads[p].copy_(g)
        self.replays += 1


def python_state(step):
    """What a CUDA graph freezes at capture but a rerun of Python would read afresh."""
    return ([(m, m.training) for m in step.model.modules()],
            [(p, p.requires_grad, p.grad) for p in step.model.parameters()],  # the graph's kernels write these
            [(g, {k: v for k, v in g.items() if k != "params"}) for g in step.optimizer.param_groups])


def apply_state(state):
    flags, params, groups = state
    for m, f in flags:
        m.training = f
    for p, r, g in params:
        p.requires_grad_(r)
        p.grad = g
    for g, values in groups:
        g.update(values)


class EmulatedGraphs:
    """CPU stand-in for ``concur.training.step._CudaGraphs``: capture runs the body once, replay reruns it frozen."""

    def __init__(self):
        self.captures = 0
        self.watch = contextlib.nullcontext  # a replay runs its body under this (tests count its ops)

    def side_stream(self):
        return contextlib.nullcontext()

    def capture(self, body, step):
        """Runs the body once for its outputs, then undoes what it did: a real capture runs no kernel."""
        self.captures += 1
        frozen = python_state(step)
        undo = Snapshot(step.model, step.optimizer, weights=True, grad_scaler=step.grad_scaler)
        try:
            out = body()
        finally:
            undo.restore()
        return _Replay(body, out, step, frozen), out

    def synchronize(self):
        pass

    def failed(self):
        pass

    def new_pool(self):
        pass

    def release_old_pool(self):
        pass

    def empty_cache(self):
        pass

    def can_time(self, device):  # a step's streams are not timed on CPU (tests that time fake it)
        return False


@pytest.fixture
def graphs(monkeypatch):
    """Make train_step take the graph path on CPU; yields the emulation (its ``captures`` count)."""
    runner = EmulatedGraphs()
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    return runner


def scheduler_step(sched, loss):
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        sched.step(loss)
    else:
        sched.step()


def plain_loop(model, opt, batches, sched=None, k=1, before_step=None, events=None):
    """PyTorch's recipe: zero_grad, forward, (loss / k).backward(), clip, step, scheduler step."""
    losses = []
    for i, (x, y) in enumerate(batches):
        if events and i in events:
            events[i](model, opt)
        if i % k == 0:
            opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        (loss / k if k > 1 else loss).backward()
        if i % k == k - 1:
            if before_step is not None:
                before_step(model, opt)
            opt.step()
            if sched is not None:
                scheduler_step(sched, loss.item())
        losses.append(loss.item())
    return losses


def concur_loop(step, model, opt, batches, sched=None, k=1, events=None):
    losses = []
    for i, (x, y) in enumerate(batches):
        if events and i in events:
            events[i](model, opt)
        loss = step(x, y)
        if i % k == k - 1 and sched is not None:
            scheduler_step(sched, loss.item())
        losses.append(loss.item())
    return losses


def run_both(make_opt, batches, *, make_sched=None, k=1, before_step=None, events=None, cuda_graph=True, **kw):
    """Train two copies, one through train_step; return (losses, expected, model, reference, step)."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)
    sched = make_sched(opt) if make_sched else None
    ref_sched = make_sched(ref_opt) if make_sched else None
    step = concur.train_step(model, loss_fn, opt, batches[0], streams=2, cuda_graph=cuda_graph, accumulate=k,
                             before_step=before_step, **kw)
    losses = concur_loop(step, model, opt, batches, sched, k, events)
    expected = plain_loop(ref, ref_opt, batches, ref_sched, k, before_step, events)
    return losses, expected, model, ref, step


def assert_same_run(losses, expected, model, ref):
    assert len(losses) == len(expected)
    for i, (a, e) in enumerate(zip(losses, expected)):
        assert abs(a - e) <= TOL * max(1.0, abs(e)), f"loss {i}: {a} vs plain loop {e}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= TOL, f"parameter {name} differs from the plain loop"
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert (b.double() - c.double()).abs().max().item() <= TOL, f"buffer {name} differs from the plain loop"


SGD_M = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
ADAMW = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.05)  # noqa: E731
LRS = torch.optim.lr_scheduler
SCHEDULERS = {
    "step": lambda o: LRS.StepLR(o, step_size=2, gamma=0.5),
    "multistep": lambda o: LRS.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "cosine": lambda o: LRS.CosineAnnealingLR(o, T_max=6),
    "onecycle": lambda o: LRS.OneCycleLR(o, max_lr=0.2, total_steps=12),  # cycles momentum / beta1 too
    "cyclic": lambda o: LRS.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),  # momentum / beta1 too
    "lambda": lambda o: LRS.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "warmup_then_cosine": lambda o: LRS.SequentialLR(
        o, [LRS.LinearLR(o, start_factor=0.1, total_iters=3), LRS.CosineAnnealingLR(o, T_max=5)], milestones=[3]),
    "plateau": lambda o: LRS.ReduceLROnPlateau(o, patience=0, factor=0.5, threshold=10.0),  # cuts every step
}


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam", "adamw"])
def test_schedulers_follow_every_step_in_graphs(graphs, opt, sched):
    """Every lr_scheduler on plain float hyperparameters, through the graph path: one capture, fresh values."""
    make_opt = {"sgd_momentum": SGD_M, "adam": ADAM, "adamw": ADAMW}[opt]
    batches = make_batches(10)
    losses, expected, model, ref, step = run_both(make_opt, batches, make_sched=SCHEDULERS[sched])
    assert_same_run(losses, expected, model, ref)
    assert graphs.captures == 1, "a new hyperparameter value must not need a new capture"


def test_onecycle_really_moves_momentum_and_betas():
    """The scheduler test above would be vacuous if OneCycleLR did not rewrite momentum and beta1."""
    model = make_model()
    for make_opt, read in ((SGD_M, lambda g: g["momentum"]), (ADAM, lambda g: g["betas"][0])):
        opt = make_opt(model)
        sched = SCHEDULERS["onecycle"](opt)
        seen = set()
        for _ in range(4):
            opt.step()
            sched.step()
            seen.add(read(opt.param_groups[0]))
        assert len(seen) == 4


def test_planted_stale_hyperparameters_are_caught(graphs, monkeypatch):
    """Planted fault: no refresh before replay (the graph keeps the lr of its capture)."""
    monkeypatch.setattr(captured_optim.DeviceHyperparameters, "refresh", lambda self: None)
    losses, expected, model, ref, _ = run_both(SGD_M, make_batches(6), make_sched=SCHEDULERS["onecycle"])
    with pytest.raises(AssertionError):
        assert_same_run(losses, expected, model, ref)


def test_emulation_bakes_floats_like_a_cuda_graph(graphs, monkeypatch):
    """Planted fault: the captured update is optimizer.step() with float lr (today's graph): schedules are lost."""
    monkeypatch.setattr(capture_mod, "captured_update", lambda step, grads: step.optimizer.step)
    monkeypatch.setattr(train_mod.TrainStep, "_hyperparameter_key", lambda self: ())
    losses, expected, model, ref, _ = run_both(SGD_M, make_batches(6), make_sched=SCHEDULERS["step"])
    with pytest.raises(AssertionError):
        assert_same_run(losses, expected, model, ref)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_other_optimizers_recapture_on_a_new_value_with_one_warning(graphs, cuda_graph):
    """RMSprop reads its lr as a float inside step(): graphs are keyed on the values (warned once)."""
    make_opt = lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5)  # noqa: E731
    with warnings_recorded() as record:
        losses, expected, model, ref, step = run_both(make_opt, make_batches(6), make_sched=SCHEDULERS["step"],
                                                      cuda_graph=cuda_graph)
    assert_same_run(losses, expected, model, ref)
    if cuda_graph:
        assert graphs.captures == 3  # lr 0.01, 0.005, 0.0025 (StepLR halves every 2 steps)
        assert sum("captured anew" in str(w.message) for w in record) == 1


@contextlib.contextmanager
def warnings_recorded():
    import warnings
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield record


CLIPS = {
    "norm": lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05),
    "value": lambda m, o: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01),
    "hook": lambda m, o: [p.grad.mul_(0.5) for g in o.param_groups for p in g["params"] if p.grad is not None],
}


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_before_step_clips_between_backward_and_step(graphs, clip, cuda_graph):
    losses, expected, model, ref, _ = run_both(SGD_M, make_batches(6), before_step=CLIPS[clip], cuda_graph=cuda_graph)
    assert_same_run(losses, expected, model, ref)
    unclipped = plain_loop(make_model(), SGD_M(make_model()), make_batches(6))
    assert max(abs(a - b) for a, b in zip(unclipped, expected)) > 1e-3, "the clip must bite"


def test_clipping_after_the_call_is_too_late():
    """Why before_step exists: clip_grad_norm_ after step(x, y) clips gradients already applied."""
    batches = make_batches(5)
    model = make_model()
    step = concur.train_step(model, loss_fn, SGD_M(model), batches[0], streams=2, cuda_graph=False)
    for x, y in batches:
        step(x, y)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    ref = make_model()
    plain_loop(ref, SGD_M(ref), batches, before_step=CLIPS["norm"])
    assert any((p - q).abs().max() > 1e-4 for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_accumulation_matches_the_recipe(graphs, k, cuda_graph):
    """k micro-batches per step (a smaller last batch inside the last cycle), with clipping and a schedule."""
    batches = make_batches(12, last=3)
    losses, expected, model, ref, step = run_both(ADAMW, batches, k=k, before_step=CLIPS["norm"],
                                                  make_sched=SCHEDULERS["onecycle"], cuda_graph=cuda_graph)
    assert_same_run(losses, expected, model, ref)
    if cuda_graph:
        positions = {key[1] for key in step.graphs}
        assert positions == ({(True, False), (False, True)} if k == 2 else
                             {(True, False), (False, False), (False, True)})


def test_planted_update_every_call_is_caught(graphs, monkeypatch):
    """Planted fault: every call is the last of its cycle (an update per micro-batch, accumulation ignored)."""
    batches = make_batches(6)
    monkeypatch.setattr(train_mod.TrainStep, "_phase", lambda self: (True, True))
    losses, expected, model, ref, _ = run_both(SGD_M, batches, k=2)
    with pytest.raises(AssertionError):
        assert_same_run(losses, expected, model, ref)


def _freeze(m, o):
    m.a.requires_grad_(False)


def _unfreeze(m, o):
    m.a.requires_grad_(True)


def _bn_eval(m, o):
    m.a[1].eval()


def _bn_train(m, o):
    m.a[1].train()


def _new_group(m, o):
    o.add_param_group({"params": list(m.head.parameters()), "lr": 0.02})


def _replace_b(m, o):
    torch.manual_seed(11)
    m.b = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid()).double()
    o.add_param_group({"params": list(m.b.parameters())})


CHANGES = {
    "freeze_then_unfreeze": {3: _freeze, 6: _unfreeze},
    "bn_eval_then_train": {3: _bn_eval, 6: _bn_train},
    "new_param_group": {4: _new_group},
    "replace_submodule": {4: _replace_b},
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw", "rmsprop"])
def test_changes_between_calls_are_seen(graphs, change, opt):
    """Each change between calls gives a new capture (or reuses the one of that state), never a stale replay."""
    make_opt = {"sgd_momentum": SGD_M, "adamw": ADAMW,
                "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01)}[opt]
    if change == "new_param_group":  # the head joins the optimizer half-way
        base = make_opt
        make_opt = lambda m: base(nn.ModuleList([m.stem, m.a, m.b]))  # noqa: E731
    losses, expected, model, ref, step = run_both(make_opt, make_batches(9), events=CHANGES[change])
    assert_same_run(losses, expected, model, ref)
    if change in ("freeze_then_unfreeze", "bn_eval_then_train"):
        assert graphs.captures == 2, "returning to the first state reuses its graph"
    else:
        assert graphs.captures == 2


@pytest.mark.parametrize("change", ["freeze_then_unfreeze", "bn_eval_then_train", "replace_submodule"])
def test_planted_fingerprint_blind_to_changes_is_caught(graphs, monkeypatch, change):
    """Planted fault: the graph key ignores the model's state (today's key: input shapes only)."""
    monkeypatch.setattr(train_mod.TrainStep, "_state_key", lambda self: ())
    # (replace_submodule: the emulation reruns Python, which reaches the new submodule and leaves the old one's
    # gradients None, so the stale update raises where a real graph would replay the old kernels silently)
    with pytest.raises((AssertionError, TypeError)):
        losses, expected, model, ref, _ = run_both(SGD_M, make_batches(9), events=CHANGES[change])
        assert_same_run(losses, expected, model, ref)


@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
def test_optimizer_load_state_dict_mid_run(graphs, opt):
    """Roll back to a checkpoint of step 3 after step 5 (model and optimizer), in both loops."""
    make_opt = {"sgd_momentum": SGD_M, "adam": ADAM}[opt]
    saved = {}

    def save(m, o):
        saved[id(m)] = (copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict()))

    def load(m, o):
        ms, os_ = saved[id(m)]
        m.load_state_dict(ms)
        o.load_state_dict(os_)

    losses, expected, model, ref, step = run_both(make_opt, make_batches(9), events={3: save, 6: load})
    assert_same_run(losses, expected, model, ref)
    assert graphs.captures == 2


def test_planted_load_state_dict_unseen_is_caught(graphs, monkeypatch):
    """Planted fault: optimizer.load_state_dict is not counted (the graph keeps updating the old state tensors)."""
    monkeypatch.setattr(torch.optim.Optimizer, "register_load_state_dict_post_hook", lambda self, hook: None)
    saved = {}

    def save(m, o):
        saved[id(m)] = copy.deepcopy(o.state_dict())

    def load(m, o):
        o.load_state_dict(saved[id(m)])

    losses, expected, model, ref, _ = run_both(SGD_M, make_batches(8), events={2: save, 5: load})
    with pytest.raises(AssertionError):
        assert_same_run(losses, expected, model, ref)


@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw"])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_checkpoint_resume_in_a_fresh_step(graphs, opt, cuda_graph):
    """Train 4 steps, checkpoint, build a fresh model/optimizer/scheduler/train_step from it, train 4 more."""
    make_opt = {"sgd_momentum": SGD_M, "adamw": ADAMW}[opt]
    batches = make_batches(8)
    model = make_model()
    opt_ = make_opt(model)
    sched = SCHEDULERS["onecycle"](opt_)
    step = concur.train_step(model, loss_fn, opt_, batches[0], streams=2, cuda_graph=cuda_graph)
    losses = concur_loop(step, model, opt_, batches[:4], sched)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt_.state_dict(), "sched": sched.state_dict()})
    model2 = make_model(seed=5)
    model2.load_state_dict(ckpt["model"])
    opt2 = make_opt(model2)
    sched2 = SCHEDULERS["onecycle"](opt2)  # PyTorch's order: build both, then load both
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    step2 = concur.train_step(model2, loss_fn, opt2, batches[0], streams=2, cuda_graph=cuda_graph)
    losses += concur_loop(step2, model2, opt2, batches[4:], sched2)
    ref = make_model()
    ref_opt = make_opt(ref)
    expected = plain_loop(ref, ref_opt, batches, SCHEDULERS["onecycle"](ref_opt))
    assert_same_run(losses, expected, model2, ref)


def test_gradients_show_in_p_grad_after_a_graph_call(graphs):
    """Under graphs p.grad is the buffer the graph accumulated into: the plain loop's gradients."""
    batches = make_batches(2)
    losses, expected, model, ref, _ = run_both(SGD_M, batches)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= TOL, name


def test_no_grad_inference_between_steps(graphs):
    """Evaluation under no_grad / inference_mode between steps changes nothing in training."""
    def evaluate(m, o):
        m.eval()
        with torch.no_grad():
            m(make_batches(1)[0][0])
        with torch.inference_mode():
            m(make_batches(1)[0][0])
        m.train()

    losses, expected, model, ref, step = run_both(ADAM, make_batches(6), events={2: evaluate, 4: evaluate})
    assert_same_run(losses, expected, model, ref)
    assert graphs.captures == 1


def test_rejects_bad_accumulate_and_before_step():
    model = make_model()
    batch = make_batches(1)[0]
    opt = SGD_M(model)
    with pytest.raises(ValueError, match="accumulate"):
        concur.train_step(model, loss_fn, opt, batch, cuda_graph=False, accumulate=0)
    with pytest.raises(TypeError, match="before_step"):
        concur.train_step(model, loss_fn, opt, batch, cuda_graph=False, before_step=1.0)


def test_state_key_costs_little_on_googlenet(graphs):
    """The per-call fingerprint on GoogLeNet (~240 modules, ~190 parameters): printed, bounded loosely."""
    import torchvision

    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = concur.train_step(model, loss_fn, opt, (torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)),
                             streams=2)
    step._check_tree()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        step._check_tree()
        step._state_key()
    per_call = (time.perf_counter() - t0) / n
    print(f"fingerprint: {per_call * 1e6:.0f} us per call on {len(list(model.modules()))} modules")
    assert per_call < 2e-3 and not math.isnan(per_call)


def test_adam_eps_change_is_a_new_capture(graphs):
    """eps stays a float in the captured update: a new value must give a new capture, not a stale one."""
    def new_eps(m, o):
        o.param_groups[0]["eps"] = 1e-3

    losses, expected, model, ref, _ = run_both(ADAM, make_batches(6), events={3: new_eps})
    assert_same_run(losses, expected, model, ref)
    assert graphs.captures == 2


def test_parameters_moved_to_new_memory_get_a_new_graph(graphs):
    """``model.to(...)``/``.half()`` after capture keeps the Parameter objects but not their memory.

    A replayed graph reads the old memory, so the step must capture again. Fails without the
    parameters' storage in the graph key (one capture for the whole run).
    """
    def new_memory(m, o):  # what Module.to/.cuda/.half do to each parameter
        with torch.no_grad():
            for p in m.parameters():
                p.data = p.data.clone()

    losses, expected, model, ref, step = run_both(SGD_M, make_batches(6), events={3: new_memory})
    assert_same_run(losses, expected, model, ref)
    assert graphs.captures == 2


def test_a_grad_scaler_whose_state_this_torch_moved_runs_the_plan_eagerly_with_one_warning(graphs):
    """Capture's warm-up steps move the loss scale, and a scaler concur cannot put back must not be captured."""
    batches = make_batches(6)
    model = make_model()
    ref = copy.deepcopy(model)
    scaler = MovedStateScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)  # every warm-up step grows it
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = concur.train_step(model, loss_fn, SGD_M(model), batches[0], streams=2, amp_dtype=torch.float16,
                                 grad_scaler=scaler)
        losses = [step(x, y).item() for x, y in batches]
    moved = [str(w.message) for w in caught if "loss scale cannot be saved and put back" in str(w.message)]
    assert len(moved) == 1 and "GradScaler has no _scale, _growth_tracker" in moved[0], moved
    assert not step.cuda_graph and graphs.captures == 0
    expected, _ = amp_recipe_loop(ref, loss_fn, SGD_M(ref), batches, torch.float16, ref_scaler)
    assert_same_run(losses, expected, model, ref)
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 16

"""Tests for the ``torch.compile`` backend (`concur.backend`) on CPU, through inductor itself.

Inductor compiles each graph whole with its C++ CPU kernels, and concur
places the launches of the generated ``call`` (:mod:`concur.inductor.wrapper_emit`):
the path a GPU takes, minus the streams themselves (on the CPU the rewritten
call runs its launches in the plan's order). Models are small, since
inductor's CPU compile is slow. Every test checks results against the
unmodified model, and the concurrency tests check the backend's ``.graphs``
records, so a plan that silently fell back to one stream fails.
"""

from __future__ import annotations

import copy
import importlib.metadata
import subprocess
import sys
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import concur
from concur.dag.cost import Roofline
from concur.inductor.stream_backend import CompiledGraphInfo, concur_backend
from tests.conftest import assert_close_rel, flat_tensors
from tests.models import BufferMutation, DropoutBranches, InplaceHazard, WideNet

pytestmark = pytest.mark.inductor  # compiles through inductor: CI runs it as its own tier

# A slow device without launch overhead, for the small synthetic models: no cluster of launches is
# too cheap to get a stream of its own (the merge threshold is a multiple of the overhead) and every
# launch outweighs an event wait, so their branches keep separate streams.
NO_MERGE = Roofline("slow-no-overhead", flops_per_us=1e3, bytes_per_us=1e2, kernel_overhead_us=0.0)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def weighted_sum(out: object) -> torch.Tensor:
    """A loss whose gradient differs per output element, so swapped values would show."""
    return sum((t * torch.linspace(0.5, 1.5, t.numel()).view_as(t)).sum() for t in flat_tensors(out))


def spy_buffer_reuse_setting(monkeypatch) -> list:
    """Record inductor's ``allow_buffer_reuse`` at each graph the backend compiles; return the record."""
    import torch._inductor.config as inductor_config

    from concur import _torch_compat as compat

    seen, compile_graph = [], compat.inductor_compile_graph

    def spy(*args, **kwargs):
        seen.append(inductor_config.allow_buffer_reuse)
        return compile_graph(*args, **kwargs)

    monkeypatch.setattr(compat, "inductor_compile_graph", spy)
    return seen


def compare_compiled(model: nn.Module, make_input, backend, *, steps: int = 2, rtol: float = 1e-5,
                     grad_rtol: float = 1e-4) -> None:
    """Check ``torch.compile(model, backend=backend)`` against a deep copy: outputs, grads, buffers."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    for step in range(steps):
        x = make_input()
        torch.manual_seed(100 + step)
        expected = reference(x)
        torch.manual_seed(100 + step)
        actual = compiled(x)
        for i, (a, e) in enumerate(zip(flat_tensors(actual), flat_tensors(expected), strict=True)):
            assert_close_rel(a, e, rtol, f"step {step} output {i}")
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        weighted_sum(expected).backward()
        weighted_sum(actual).backward()
        ref_params = dict(reference.named_parameters())
        grads, ref_grads = [], []
        for name, p in model.named_parameters():
            ge = ref_params[name].grad
            assert (p.grad is None) == (ge is None), name
            if ge is not None:
                assert_close_rel(p.grad, ge, grad_rtol, f"step {step} grad {name}")
                grads.append(p.grad.flatten())
                ref_grads.append(ge.flatten())
        assert grads
        assert_close_rel(torch.cat(grads), torch.cat(ref_grads), rtol, f"step {step} all grads")
        ref_buffers = dict(reference.named_buffers())
        for name, b in model.named_buffers():
            assert_close_rel(b.double(), ref_buffers[name].double(), rtol, f"step {step} buffer {name}")


def forward_and_backward(graphs: list[CompiledGraphInfo]) -> tuple[CompiledGraphInfo, CompiledGraphInfo]:
    (fw,) = [g for g in graphs if not g.is_backward]
    (bw,) = [g for g in graphs if g.is_backward]
    return fw, bw


def assert_concurrent(graphs: list[CompiledGraphInfo]) -> None:
    """Both graphs were read and their launches put on several streams that really wait on each other."""
    for g in forward_and_backward(graphs):
        assert g.fallback_reason is None and g.one_stream_reason is None, g
        assert g.num_streams > 1 and g.num_launches > 1 and g.num_waits > 0 and g.num_barriers == 0, g


# ---------------------------------------------------------------- equality and concurrency


class MiniInception(nn.Module):
    """An Inception block in miniature: 1x1, 3x3, double 3x3 and pooled branches, concatenated."""

    def __init__(self, c: int = 4):
        super().__init__()
        conv = lambda cin, cout, k: nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2), nn.ReLU())  # noqa: E731
        self.stem = conv(3, c, 3)
        self.b1 = conv(c, c, 1)
        self.b3 = nn.Sequential(conv(c, c, 1), conv(c, c, 3))
        self.b33 = nn.Sequential(conv(c, c, 1), conv(c, c, 3), conv(c, c, 3))
        self.pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), conv(c, c, 1))
        self.head = nn.Linear(4 * c, 10)

    def forward(self, x):
        s = self.stem(x)
        y = torch.cat([self.b1(s), self.b3(s), self.b33(s), self.pool(s)], dim=1)
        return self.head(F.dropout(F.adaptive_avg_pool2d(y, 1).flatten(1), 0.2, self.training))


def test_inception_block_train_mode():
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    with torch._inductor.config.patch(fallback_random=True):  # dropout draws as eager's
        compare_compiled(MiniInception().train(), lambda: torch.randn(2, 3, 8, 8), backend)
    assert_concurrent(backend.graphs)


def test_every_graph_allocates_its_side_stream_buffers_on_the_callers_stream(monkeypatch):
    """Forward and backward alike: a buffer made on a side stream serves only that stream once freed, so the
    blocks the caller's stream frees (a forward's saved activations, in backward) would serve none of them."""
    from concur.inductor import stream_backend

    asked, place = [], stream_backend.place_kernels

    def spy(*args, **kwargs):
        asked.append((kwargs["label"].startswith("the backward"), kwargs["allocate_on_caller"]))
        return place(*args, **kwargs)

    monkeypatch.setattr(stream_backend, "place_kernels", spy)
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    compare_compiled(WideNet(branches=3, channels=4), lambda: torch.randn(2, 3, 8, 8), backend, steps=1)
    assert sorted(set(asked)) == [(False, True), (True, True)]


def test_a_backward_narrowed_for_memory_runs_on_two_streams_and_computes_the_same():
    """ConcurBackend.narrow_plans places a backward graph on more than 2 streams again on 2, from the wrapper it
    read (nothing recompiles), then with its aten calls on the caller's stream, then on one: what runs at each
    step, and after a switch off and on, equals the unmodified model."""
    torch.manual_seed(0)
    model = WideNet(branches=4, channels=4)
    reference = copy.deepcopy(model)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    compiled = torch.compile(model, backend=backend)

    def same_step(seed):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        actual, expected = compiled(x), reference(x)
        weighted_sum(actual).backward()
        weighted_sum(expected).backward()
        assert_close_rel(actual, expected, 1e-5, "output")
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert_close_rel(p.grad, ref_params[name].grad, 1e-4, name)

    same_step(0)
    fw, bw = forward_and_backward(backend.graphs)
    assert bw.num_streams > 2, bw
    assert backend.narrow_plans("out of memory") == "on at most 2 streams"
    fw_after, bw_after = forward_and_backward(backend.graphs)
    assert fw_after == fw and bw_after.num_streams == 2 and bw_after.decided_by == "memory", bw_after
    assert bw_after.num_waits > 0 and bw_after.fallback_reason is None
    same_step(1)
    for _, plan in backend.running_plans():
        plan.use_streams(False)
        plan.use_streams(True)
    same_step(2)
    lean = backend.narrow_plans("out of memory")  # inductor's kernels beside the convolutions on the caller's
    assert lean.startswith("on at most ") and lean.endswith(" streams, aten's calls on the caller's"), lean
    assert forward_and_backward(backend.graphs)[1].num_streams > 1
    same_step(3)
    assert backend.narrow_plans("out of memory") == "on 1 stream"
    assert forward_and_backward(backend.graphs)[1].num_streams == 1
    same_step(4)


@pytest.mark.parametrize("scheduler", ["critical_path", "fork"])
def test_wide_net(scheduler):
    torch.manual_seed(0)
    backend = concur.backend(streams=4, scheduler=scheduler, roofline=NO_MERGE)
    compare_compiled(WideNet(branches=4, channels=4), lambda: torch.randn(2, 3, 8, 8), backend)
    if scheduler == "critical_path":
        assert_concurrent(backend.graphs)
    else:  # fork spreads branches without weighing them: some graph may need no wait
        assert all(g.fallback_reason is None and g.num_barriers == 0 for g in backend.graphs), backend.graphs
        assert max(g.num_streams for g in backend.graphs) > 1, backend.graphs


def test_dropout_branches_draw_in_program_order():
    # fallback_random: inductor draws with eager's kernels, so eager is the reference bit for bit and
    # any reordering of the draws shows
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    with torch._inductor.config.patch(fallback_random=True):
        compare_compiled(DropoutBranches().train(), lambda: torch.randn(4, 16), backend, rtol=1e-6)
    fw, bw = forward_and_backward(backend.graphs)
    assert fw.fallback_reason is None and bw.fallback_reason is None, (fw, bw)
    assert bw.num_streams > 1, bw  # the forward's draws are one chain (each writes the generator)


@pytest.mark.parametrize("model_cls", [InplaceHazard, BufferMutation])
def test_in_place_models(model_cls):
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    model = model_cls()
    compare_compiled(model, lambda: torch.randn(2, 3, 8, 8), backend, steps=3)
    assert all(g.fallback_reason is None and g.num_barriers == 0 for g in backend.graphs), backend.graphs
    if model_cls is BufferMutation:
        assert model.calls.item() == 3 and model.ema.abs().sum() > 0  # the buffers really moved


class ChainWithShortcut(nn.Module):
    """A ResNet-like block: eight 3x3 convolutions beside one cheap 1x1 shortcut."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.chain = nn.Sequential(*[nn.Conv2d(channels, channels, 3, padding=1) for _ in range(8)])
        self.shortcut = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return self.chain(x) + self.shortcut(x)


@pytest.mark.parametrize("min_gain", [None, 1.5])
def test_a_graph_predicted_to_gain_little_keeps_inductors_call(min_gain):
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=NO_MERGE, min_predicted_speedup=min_gain)
    compare_compiled(ChainWithShortcut(), lambda: torch.randn(2, 16, 8, 8), backend, steps=1)
    fw, _ = forward_and_backward(backend.graphs)
    assert all(g.fallback_reason is None for g in backend.graphs)  # a decision, not a failure
    assert fw.ideal_speedup < 1.5, fw  # the shortcut is cheap beside the chain
    if min_gain is None:  # the default places any schedule on several streams
        assert fw.num_streams == 2 and fw.one_stream_reason is None, fw
    else:
        assert fw.num_streams == 1 and "below 1.5x" in fw.one_stream_reason, fw


def test_the_gate_counts_kernels_sharing_the_device():
    # Four branches: alone on the device each would finish in parallel (ideal gain near the branch
    # count), but on NO_MERGE every kernel keeps its bound resource busy, so together they run no
    # faster than one after the other and a gate of 1.1 keeps inductor's call.
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=NO_MERGE, min_predicted_speedup=1.1)
    compare_compiled(WideNet(branches=4, channels=4), lambda: torch.randn(2, 3, 8, 8), backend, steps=1)
    fw, _ = forward_and_backward(backend.graphs)
    assert fw.ideal_speedup > 1.5 and fw.predicted_speedup < 1.1, fw
    assert (fw.num_streams, fw.fallback_reason) == (1, None) and "predicted" in fw.one_stream_reason, fw


def test_the_default_gate_never_installs_a_plan_predicted_slower_than_one_stream(monkeypatch, caplog):
    # Real rooflines predict below 1.0 only for big timm graphs; here the shared-device simulation is
    # made to predict every plan 3x slower than one stream, which the default gate must refuse.
    import schedulers
    real = schedulers.simulate_shared
    monkeypatch.setattr(schedulers, "simulate_shared", lambda dag, schedule: 3.0 * sum(
        dag.nodes[v]["cost"] for v in dag) + 0.0 * real(dag, schedule))
    torch.manual_seed(0)
    backend = concur.backend(streams=4, roofline=NO_MERGE)
    with caplog.at_level(logging.INFO, logger="concur"):
        compare_compiled(WideNet(branches=4, channels=4), lambda: torch.randn(2, 3, 8, 8), backend, steps=1)
    assert backend.graphs and all(
        g.num_streams == 1 and g.fallback_reason is None and g.predicted_speedup < 0.4
        and "(0.33x, kernels sharing the device), below 1x" in g.one_stream_reason for g in backend.graphs), backend.graphs
    lines = [r.getMessage() for r in caplog.records if "runs on one stream:" in r.getMessage()]
    assert len(lines) == len(backend.graphs) and "below 1x" in lines[0], lines


def test_one_stream_is_inductors_own_call():
    torch.manual_seed(0)
    backend = concur.backend(streams=1)
    compare_compiled(TwoBranches(), lambda: torch.randn(4, 8), backend, steps=1)
    assert [(g.num_streams, g.num_waits, g.fallback_reason, g.one_stream_reason) for g in backend.graphs] \
        == [(1, 0, None, "streams=1")] * 2


# ---------------------------------------------------------------- registration


def small_wide() -> nn.Module:
    torch.manual_seed(0)
    return WideNet(branches=3, channels=4)


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.a(x)) * torch.sigmoid(self.b(x))


def test_backend_is_registered_under_its_name():
    assert torch._dynamo.lookup_backend("concur") is concur_backend
    torch.manual_seed(0)
    model, x = TwoBranches(), torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend="concur")(x)
    assert_close_rel(actual, expected, 1e-5, "output")


def test_backend_is_found_through_its_entry_point_without_importing_concur():
    names = {e.name: e.value for e in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    if names.get("concur") != "concur.backend:concur_backend":
        pytest.skip("concur's torch_dynamo_backends entry point is not installed "
                    "(pip install -e . after pyproject.toml declares it)")
    code = ("import sys, torch\n"
            "assert 'concur' not in sys.modules\n"
            "fn = torch._dynamo.lookup_backend('concur')\n"
            "print(fn.__module__, fn.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["concur.inductor.stream_backend", "concur_backend"]


# ---------------------------------------------------------------- fallbacks and errors


def test_dynamic_shapes_fall_back_with_one_warning_naming_why():
    torch.manual_seed(0)
    model = TwoBranches()
    reference = copy.deepcopy(model)
    backend = concur.backend(streams=4)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with pytest.warns(UserWarning, match=r"dynamic \(symbolic\) shapes") as caught:
        out = compiled(torch.ones(2, 8))
        out.sum().backward()
    ours = [w for w in caught if "concur backend" in str(w.message)]
    assert len(ours) == 1 and len(backend.graphs) == 2  # one warning for the forward and the backward
    assert all("dynamic (symbolic) shapes" in g.fallback_reason for g in backend.graphs)
    assert all(g.num_streams == 1 for g in backend.graphs)
    assert_close_rel(out, reference(torch.ones(2, 8)), 1e-5, "output")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new batch size reuses the dynamic graph: no new warning
        x = torch.randn(3, 8)
        assert_close_rel(compiled(x), reference(x), 1e-5, "output, batch 3")
    assert len(backend.graphs) == 2


@pytest.mark.parametrize("kwargs,match", [
    ({"streams": 0}, "streams"),
    ({"streams": True}, "streams"),
    ({"streams": 2.0}, "streams"),
    ({"scheduler": "round_robin"}, "critical_path"),
    ({"min_predicted_speedup": 0.5}, "min_predicted_speedup"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        concur.backend(**kwargs)


@pytest.mark.parametrize("removed", [{"strategy": "segments"}, {"segment_compiler": "eager"},
                                     {"event_delay_launches": 5.0}])
def test_the_segments_options_are_gone(removed):
    with pytest.raises(TypeError):
        concur.backend(**removed)


# ---------------------------------------------------------------- train_step(compile=True)


def test_train_step_compile_trains_like_the_plain_loop():
    model = small_wide()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(3)]
    with pytest.warns(UserWarning, match="no CUDA"):
        step = concur.train_step(model, F.cross_entropy, opt, batches[0], streams=4, compile=True,
                                 compile_options={"roofline": NO_MERGE})
    for i, (x, y) in enumerate(batches):
        loss = step(x, y)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert_close_rel(loss, ref_loss.detach(), 1e-5, f"step {i} loss")
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close_rel(p.detach(), ref_params[name].detach(), 1e-5, f"param {name}")
    ref_buffers = dict(reference.named_buffers())
    for name, b in model.named_buffers():
        assert_close_rel(b.double(), ref_buffers[name].double(), 1e-5, f"buffer {name}")
    (backend,) = step.backends.values()
    assert_concurrent(backend.graphs)

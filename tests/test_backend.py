"""Tests for the ``torch.compile`` backend (`concur.backend`) on CPU.

Most tests use ``segment_compiler="eager"``: the same graphs, schedules,
segments and runner as with inductor, without inductor's slow CPU compile.
One small model goes through inductor itself, and once more through
``train_step(compile=True)``. Every test checks results against the
unmodified model, and the concurrency tests check the backend's ``.graphs``
records, so a plan that silently fell back to one stream fails.
"""

from __future__ import annotations

import copy
import importlib.metadata
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import concur
from concur.backend import CompiledGraphInfo, concur_backend
from concur.cost import ROOFLINES, Roofline
from tests.conftest import assert_close_rel, flat_tensors
from tests.models import BufferMutation, DropoutBranches, InplaceHazard, WideNet

torchvision = pytest.importorskip("torchvision")

# A slow device without launch overhead, for the small synthetic models: no cluster is too cheap
# to be a segment (the merge threshold is a multiple of the overhead) and every op outweighs an
# event wait, so their branches keep separate streams.
NO_MERGE = Roofline("slow-no-overhead", flops_per_us=1e3, bytes_per_us=1e2, kernel_overhead_us=0.0)
# Tests of how graphs are cut turn the gate off: on these small CPU graphs every kernel would keep
# the modelled device busy, so the contention-aware prediction says streams gain nothing.
CUT_ALL = {"min_predicted_speedup": 1.0}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def weighted_sum(out: object) -> torch.Tensor:
    """A loss whose gradient differs per output element, so swapped values would show."""
    return sum((t * torch.linspace(0.5, 1.5, t.numel()).view_as(t)).sum() for t in flat_tensors(out))


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
    """Both graphs were cut into segments on several streams that really wait on each other."""
    for g in forward_and_backward(graphs):
        assert g.fallback_reason is None, g
        assert g.num_streams > 1 and g.num_segments > 1 and g.num_waits > 0, g


# ---------------------------------------------------------------- equality, eager segments


@pytest.mark.parametrize("name,size", [("googlenet", 64), ("inception_v3", 75)])
def test_torchvision_model_train_mode(name, size):
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, aux_logits=False, init_weights=False).train()
    backend = concur.backend(streams=4, segment_compiler="eager", **CUT_ALL)
    compare_compiled(model, lambda: torch.randn(2, 3, size, size), backend, steps=1)
    assert_concurrent(backend.graphs)


def test_googlenet_with_delayed_events_has_fewer_backward_segments_and_equal_results():
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False, dropout=0.0).train()
    counts = {}
    for delay in (0.0, 5.0):
        backend = concur.backend(streams=4, segment_compiler="eager", event_delay_launches=delay, **CUT_ALL)
        compare_compiled(copy.deepcopy(model), lambda: torch.randn(2, 3, 64, 64), backend, steps=1)
        assert_concurrent(backend.graphs)
        counts[delay] = [g.num_segments for g in forward_and_backward(backend.graphs)]
        torch._dynamo.reset()
    assert counts[5.0][1] < counts[0.0][1] and counts[5.0][0] <= counts[0.0][0], counts


@pytest.mark.parametrize("scheduler", ["critical_path", "fork"])
def test_wide_net(scheduler):
    torch.manual_seed(0)
    backend = concur.backend(streams=4, scheduler=scheduler, segment_compiler="eager", roofline=NO_MERGE,
                             **CUT_ALL)
    compare_compiled(WideNet(branches=6, channels=4), lambda: torch.randn(2, 3, 8, 8), backend)
    assert_concurrent(backend.graphs)


def test_dropout_branches_draw_in_program_order():
    torch.manual_seed(0)
    backend = concur.backend(streams=4, segment_compiler="eager", roofline=NO_MERGE, **CUT_ALL)
    compare_compiled(DropoutBranches().train(), lambda: torch.randn(4, 16), backend, rtol=1e-6)
    assert_concurrent(backend.graphs)


@pytest.mark.parametrize("model_cls", [InplaceHazard, BufferMutation])
def test_in_place_models(model_cls):
    # After functionalization their side branches are cheap pointwise work that reaches no heavy
    # kernel, so coarsen keeps them with the main chain: equality is what these guard.
    torch.manual_seed(0)
    backend = concur.backend(streams=4, segment_compiler="eager", roofline=NO_MERGE, **CUT_ALL)
    model = model_cls()
    compare_compiled(model, lambda: torch.randn(2, 3, 8, 8), backend, steps=3)
    assert all(g.fallback_reason is None for g in backend.graphs)
    if model_cls is BufferMutation:
        assert model.calls.item() == 3 and model.ema.abs().sum() > 0  # the buffers really moved


class ChainWithShortcut(nn.Module):
    """A ResNet-like block: eight 3x3 convolutions beside one cheap 1x1 shortcut."""

    def __init__(self, channels: int = 32):
        super().__init__()
        self.chain = nn.Sequential(*[nn.Conv2d(channels, channels, 3, padding=1) for _ in range(8)])
        self.shortcut = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return self.chain(x) + self.shortcut(x)


@pytest.mark.parametrize("min_gain", [None, 1.0])
def test_a_graph_predicted_to_gain_little_is_compiled_whole(min_gain):
    torch.manual_seed(0)
    options = {} if min_gain is None else {"min_predicted_speedup": min_gain}
    backend = concur.backend(streams=4, segment_compiler="eager", roofline=NO_MERGE, **options)
    compare_compiled(ChainWithShortcut(), lambda: torch.randn(2, 32, 8, 8), backend, steps=1)
    streams = [g.num_streams for g in backend.graphs]
    assert streams == ([1, 1] if min_gain is None else [2, 2]), streams  # the shortcut is cheap beside the chain
    assert all(g.fallback_reason is None for g in backend.graphs)  # a decision, not a failure


def test_the_gate_counts_kernels_sharing_the_device():
    # Six equal branches: alone on the device each would finish in parallel (ideal gain near the
    # branch count), but on NO_MERGE every kernel keeps its bound resource busy, so together they
    # run no faster than one after the other and the graph is compiled whole.
    torch.manual_seed(0)
    backend = concur.backend(streams=4, segment_compiler="eager", roofline=NO_MERGE)
    compare_compiled(WideNet(branches=6, channels=4), lambda: torch.randn(2, 3, 8, 8), backend, steps=1)
    for g in backend.graphs:
        assert g.ideal_speedup > 1.5 and g.predicted_speedup < 1.1, g
        assert (g.num_streams, g.num_segments, g.fallback_reason) == (1, 1, None), g


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_cuda_graph_of_nchw_convolutions_is_compiled_whole_with_a_warning(channels_last, monkeypatch):
    # Inductor makes a CUDA convolution graph channels-last as a whole; cut into segments that keep
    # NCHW at the cuts it lost on the H100. The device check is faked: the graphs are the same.
    backend_module = sys.modules["concur.backend"]  # `concur.backend` is also the function
    monkeypatch.setattr(backend_module, "_device_of", lambda inputs: torch.device("cuda"))
    torch.manual_seed(0)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).to(memory_format=layout)
    backend = concur.backend(streams=4, segment_compiler="eager", roofline=ROOFLINES["cpu"], **CUT_ALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compare_compiled(model, lambda: torch.randn(2, 3, 64, 64).to(memory_format=layout), backend, steps=1)
    warned = any("channels-last" in str(w.message) for w in caught)
    if channels_last:
        assert not warned
        assert_concurrent(backend.graphs)
    else:
        assert warned
        assert [(g.num_streams, g.fallback_reason) for g in backend.graphs] == [(1, None)] * 2


def test_one_stream_is_the_whole_graph():
    torch.manual_seed(0)
    backend = concur.backend(streams=1, segment_compiler="eager")
    compare_compiled(WideNet(branches=3, channels=4), lambda: torch.randn(2, 3, 8, 8), backend, steps=1)
    assert [(g.num_segments, g.num_streams, g.num_waits) for g in backend.graphs] == [(1, 1, 0)] * 2


# ---------------------------------------------------------------- inductor


def small_wide() -> nn.Module:
    torch.manual_seed(0)
    return WideNet(branches=3, channels=4)


def test_inductor_segments_equal_eager():
    backend = concur.backend(streams=4, roofline=ROOFLINES["cpu"], strategy="segments", **CUT_ALL)
    compare_compiled(small_wide(), lambda: torch.randn(4, 3, 8, 8), backend)
    fw, bw = forward_and_backward(backend.graphs)
    assert fw.fallback_reason is None and bw.fallback_reason is None
    assert fw.num_segments > 1 and fw.num_streams > 1 and fw.num_waits > 0, fw
    assert bw.num_segments > 1 and bw.num_streams > 1, bw


def test_kernel_waits_run_once_the_segments_are_compiled(monkeypatch):
    from torch._inductor.async_compile import AsyncCompile

    from concur import _torch_compat as compat

    waited: list[dict] = []
    fake_wait = lambda compiler, scope: waited.append(scope)  # noqa: E731
    monkeypatch.setattr(AsyncCompile, "wait", fake_wait)
    compiler = object.__new__(AsyncCompile)
    with compat.deferred_kernel_compiles():
        compiler.wait({"segment": 0})
        compiler.wait({"segment": 1})
        assert waited == []  # not while segments are still being compiled
    assert waited == [{"segment": 0}, {"segment": 1}] and AsyncCompile.wait is fake_wait
    with pytest.raises(RuntimeError), compat.deferred_kernel_compiles():
        compiler.wait({"segment": 2})
        raise RuntimeError("inductor rejected a segment")
    assert len(waited) == 2 and AsyncCompile.wait is fake_wait  # a failed compile waits for nothing


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
    assert out.stdout.split()[-2:] == ["concur.backend", "concur_backend"]


# ---------------------------------------------------------------- fallbacks and errors


def test_dynamic_shapes_fall_back_with_one_warning_naming_why():
    torch.manual_seed(0)
    model = WideNet(branches=3, channels=4)
    reference = copy.deepcopy(model)
    backend = concur.backend(streams=4, segment_compiler="eager", **CUT_ALL)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with pytest.warns(UserWarning, match=r"dynamic \(symbolic\) shapes") as caught:
        out = compiled(torch.ones(2, 3, 8, 8))
        out.sum().backward()
    ours = [w for w in caught if "concur backend" in str(w.message)]
    assert len(ours) == len(backend.graphs) == 2  # one per graph: forward and backward
    assert all("dynamic (symbolic) shapes" in g.fallback_reason for g in backend.graphs)
    assert all(g.num_segments == 1 for g in backend.graphs)
    assert_close_rel(out, reference(torch.ones(2, 3, 8, 8)), 1e-5, "output")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new batch size reuses the dynamic graph: no new warning
        x = torch.randn(3, 3, 8, 8)
        assert_close_rel(compiled(x), reference(x), 1e-5, "output, batch 3")
    assert len(backend.graphs) == 2


@pytest.mark.parametrize("kwargs,match", [
    ({"streams": 0}, "streams"),
    ({"streams": True}, "streams"),
    ({"streams": 2.0}, "streams"),
    ({"scheduler": "round_robin"}, "critical_path"),
    ({"segment_compiler": "tvm"}, "segment_compiler"),
    ({"event_delay_launches": -1}, "event_delay_launches"),
    ({"min_predicted_speedup": 0.5}, "min_predicted_speedup"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        concur.backend(**kwargs)


# ---------------------------------------------------------------- train_step(compile=True)


def test_train_step_compile_trains_like_the_plain_loop():
    model = small_wide()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(3)]
    with pytest.warns(UserWarning, match="no CUDA"):
        step = concur.train_step(model, F.cross_entropy, opt, batches[0], streams=4, compile=True)
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
    fw, bw = forward_and_backward(backend.graphs)
    assert fw.fallback_reason is None and fw.num_segments > 1, fw

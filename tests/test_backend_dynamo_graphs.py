"""Every shape of graph dynamo hands the concur backend compiles and runs like eager (CPU, inductor's C++ kernels).

Each case goes through ``torch.compile(..., backend=concur.backend(streams=4))``
and the default path (inductor compiles the graph whole, concur places its
launches), and is checked against eager: values, gradients where there is a
backward, and mutated inputs and buffers. A graph concur cannot schedule
must run inductor's own output with one warning naming why; a graph with
nothing to schedule (0 or 1 launch) must run it without a warning, its reason
recorded in ``ConcurBackend.graphs``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import concur
from concur import _torch_compat as compat
from concur.dag.cost import Roofline
from tests.conftest import assert_close_rel, flat_tensors

pytestmark = pytest.mark.inductor  # compiles through inductor: CI runs it as its own tier

# A slow device without launch overhead: on these tiny graphs every launch outweighs an event, so
# independent launches go to separate streams and the rewritten call is what runs.
NO_MERGE = Roofline("slow-no-overhead", flops_per_us=1e3, bytes_per_us=1e2, kernel_overhead_us=0.0)


def streams_backend() -> concur.backend:
    return concur.backend(streams=4, roofline=NO_MERGE)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def concur_warnings():
    """Collect concur's warnings; at most one may come, and it must say why."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours: list[str] = []
        yield ours
    ours += [str(w.message) for w in caught if "concur" in str(w.message)]
    assert len(ours) <= 1, ours
    assert all("because" in m for m in ours), ours


def check(fn: Callable, make_args: Callable[[], tuple], backend: Any, *, steps: int = 2,
          dynamic: bool | None = None, prepare: Callable[[tuple], None] | None = None,
          context: Callable[[], Any] = contextlib.nullcontext) -> list[str]:
    """Compare ``torch.compile(fn)`` with ``fn`` on fresh copies of the same arguments; return concur's warnings.

    Outputs, the gradients of every floating input that requires one, and
    every argument afterwards (in-place updates) must match.
    """
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    with concur_warnings() as ours:
        for step in range(steps):
            args = make_args()
            if prepare is not None:
                prepare(args)
            expected_args, actual_args = copy.deepcopy(args), copy.deepcopy(args)
            torch.manual_seed(step)
            with context():
                expected = fn(*expected_args)
            torch.manual_seed(step)
            with context():
                actual = compiled(*actual_args)
            for i, (a, e) in enumerate(zip(flat_tensors(actual), flat_tensors(expected), strict=True)):
                assert_close_rel(a.detach(), e.detach(), 1e-5, f"step {step} output {i}")
            for i, (a, e) in enumerate(zip(flat_tensors(actual_args), flat_tensors(expected_args), strict=True)):
                assert_close_rel(a.detach(), e.detach(), 1e-5, f"step {step} argument {i} after the call")
            outs = [(a, e) for a, e in zip(flat_tensors(actual), flat_tensors(expected)) if e.requires_grad]
            if outs:
                weights = [torch.linspace(0.5, 1.5, e.numel()).view_as(e) for _, e in outs]
                sum((e * w).sum() for (_, e), w in zip(outs, weights)).backward()
                sum((a * w).sum() for (a, _), w in zip(outs, weights)).backward()
                for i, (a, e) in enumerate(zip(flat_tensors(actual_args), flat_tensors(expected_args))):
                    if e.grad is not None:
                        assert_close_rel(a.grad, e.grad, 1e-4, f"step {step} gradient of argument {i}")
    return ours


def check_module(model: nn.Module, make_input: Callable[[], torch.Tensor], backend: Any, *, steps: int = 2,
                 context: Callable[[], Any] = contextlib.nullcontext, grads: bool = True) -> list[str]:
    """Compare a compiled module with a deep copy: outputs, parameter gradients and buffers."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    with concur_warnings() as ours:
        for step in range(steps):
            x = make_input()
            torch.manual_seed(step)
            with context():
                expected = reference(x)
            torch.manual_seed(step)
            with context():
                actual = compiled(x)
            assert_close_rel(actual.detach(), expected.detach(), 1e-5, f"step {step} output")
            if grads:
                reference.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
                w = torch.linspace(0.5, 1.5, expected.numel()).view_as(expected)
                (expected * w).sum().backward()
                (actual * w).sum().backward()
                ref = dict(reference.named_parameters())
                for name, p in model.named_parameters():
                    assert_close_rel(p.grad, ref[name].grad, 1e-4, f"step {step} grad {name}")
            ref_buffers = dict(reference.named_buffers())
            for name, b in model.named_buffers():
                assert_close_rel(b.double(), ref_buffers[name].double(), 1e-5, f"step {step} buffer {name}")
    return ours


def trivially_serial(backend: concur.backend) -> bool:
    return all(g.fallback_reason is None and g.num_streams == 1 and g.one_stream_reason for g in backend.graphs)


def placed(backend: concur.backend, backward: bool | None = None) -> bool:
    """Every graph was read; those of the given direction (all if None) run on several streams."""
    graphs = [g for g in backend.graphs if backward is None or g.is_backward == backward]
    return bool(graphs) and all(g.fallback_reason is None for g in backend.graphs) \
        and all(g.num_streams > 1 and g.one_stream_reason is None for g in graphs)


# ---------------------------------------------------------------- 0, 1 and 2 launches


def test_one_launch_runs_inductors_output_without_a_warning():
    backend = streams_backend()
    warned = check(lambda x: torch.relu(x) * 2, lambda: (torch.randn(4, 8),), backend)
    assert warned == []
    (g,) = backend.graphs
    assert (g.num_launches, g.num_streams, g.fallback_reason) == (1, 1, None)
    assert "1 kernel launch" in g.one_stream_reason


def test_the_registered_name_compiles_a_one_launch_lambda():
    fn = torch.compile(lambda x: torch.relu(x) * 2, backend="concur")
    with concur_warnings() as ours:
        x = torch.randn(4)
        assert_close_rel(fn(x), torch.relu(x) * 2, 1e-6, "output")
    assert ours == []


def test_views_only_graph_has_no_launch_and_no_warning():
    backend = streams_backend()
    warned = check(lambda x: (x.t(), x[1:].view(-1)), lambda: (torch.randn(3, 4, requires_grad=True),), backend)
    assert warned == []
    assert trivially_serial(backend), backend.graphs


def test_two_independent_launches_and_their_backward():
    backend = streams_backend()
    warned = check(lambda x, a, b: (x @ a, torch.tanh(x @ b)),
                   lambda: (torch.randn(8, 16), torch.randn(16, 16, requires_grad=True),
                            torch.randn(16, 16, requires_grad=True)), backend)
    assert warned == []
    assert len(backend.graphs) == 2 and placed(backend), backend.graphs


# ---------------------------------------------------------------- graph breaks


class Broken(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.a(x))
        if self.how == "print":
            print("between the two halves", file=sys.stderr)
        else:
            torch._dynamo.graph_break()
        return torch.sigmoid(self.b(y)) + y


@pytest.mark.parametrize("how", ["print", "graph_break"])
def test_a_graph_break_compiles_each_piece(how):
    torch.manual_seed(0)
    backend = streams_backend()
    warned = check_module(Broken(how), lambda: torch.randn(4, 8), backend)
    assert warned == []
    assert len(backend.graphs) >= 4, backend.graphs  # two pieces, each a forward and a backward
    assert all(g.fallback_reason is None for g in backend.graphs), backend.graphs


# ---------------------------------------------------------------- aliasing and in-place updates


def test_outputs_that_alias_inputs():
    backend = streams_backend()
    warned = check(lambda x, y: (x.view(-1), x, torch.sin(x @ y) + torch.cos(y @ x), y[:2]),
                   lambda: (torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)), backend)
    assert warned == []
    assert placed(backend, backward=False), backend.graphs


def update_inputs(x, y, w, counter):
    x.mul_(2)
    counter.add_(1)
    return torch.sin(x @ w), torch.cos(y @ w).sum()


def test_in_place_updates_of_inputs():
    backend = streams_backend()
    warned = check(update_inputs, lambda: (torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8), torch.zeros(())),
                   backend, steps=3)
    assert warned == []
    assert placed(backend), backend.graphs


class TwoNorms(nn.Module):
    """Two BatchNorm branches: running statistics are buffers updated in place inside the graph."""

    def __init__(self):
        super().__init__()
        # no conv bias: BatchNorm cancels it, so its gradient is rounding noise around zero
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
        self.b = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4))

    def forward(self, x):
        return torch.relu(self.a(x)) * torch.sigmoid(self.b(x))


def test_batchnorm_buffers_move_like_eager():
    torch.manual_seed(0)
    backend = streams_backend()
    model = TwoNorms().train()
    warned = check_module(model, lambda: torch.randn(2, 3, 6, 6), backend, steps=3)
    assert warned == []
    assert placed(backend), backend.graphs
    assert model.a[1].num_batches_tracked.item() == 3


# ---------------------------------------------------------------- RNG


class TwoDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return nn.functional.dropout(self.a(x), 0.5) + nn.functional.dropout(torch.tanh(self.b(x)), 0.3)


def test_random_draws_keep_eagers_order():
    # fallback_random: inductor draws with eager's kernels, so eager is the reference bit for bit
    torch.manual_seed(0)
    backend = streams_backend()
    with torch._inductor.config.patch(fallback_random=True):
        warned = check_module(TwoDropouts().train(), lambda: torch.randn(8, 16), backend)
    assert warned == []
    assert placed(backend, backward=True), backend.graphs  # the forward's draws are one chain


# ---------------------------------------------------------------- no_grad, inference_mode


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_graphs_without_autograd(mode):
    torch.manual_seed(0)
    backend = streams_backend()
    warned = check_module(TwoNorms().eval(), lambda: torch.randn(2, 3, 6, 6), backend, context=mode, grads=False)
    assert warned == []
    assert [g.is_backward for g in backend.graphs] == [False], backend.graphs
    assert placed(backend), backend.graphs


# ---------------------------------------------------------------- dynamic shapes


def two_branches(x, w):
    return torch.relu(x @ w) + torch.sigmoid(x).sum(1, keepdim=True)


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_shapes_run_inductors_output_with_one_warning(how):
    backend = streams_backend()
    sizes = iter([4, 6, 4])

    def make():
        return torch.randn(next(sizes), 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    mark = (lambda args: torch._dynamo.mark_dynamic(args[0], 0)) if how == "mark_dynamic" else None
    warned = check(two_branches, make, backend, steps=3, dynamic=True if how == "dynamic=True" else None,
                   prepare=mark)
    assert len(warned) == 1 and "dynamic (symbolic) shapes" in warned[0], warned
    assert backend.graphs and all("dynamic" in g.fallback_reason for g in backend.graphs), backend.graphs


# ---------------------------------------------------------------- torch versions


def test_an_untested_torch_warns_once_and_still_runs_like_eager(monkeypatch):
    newest = max(compat.TESTED_TORCH)
    monkeypatch.setattr(compat, "torch_version", lambda: (newest[0], newest[1] + 1))  # one past the newest
    monkeypatch.setattr(compat, "_warned_untested", [])
    assert "is not one of the releases" in compat.untested_torch()
    backend = streams_backend()
    fn = torch.compile(two_branches, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (4, 5):  # the second size compiles again: still one warning
            x, w = torch.randn(n, 8), torch.randn(8, 8)
            assert_close_rel(fn(x, w), two_branches(x, w), 1e-5, "output")
    untested = [str(w.message) for w in caught if "is not one of the releases" in str(w.message)]
    assert len(untested) == 1 and "(2.11, 2.13, 2.14 and 2.15)" in untested[0], untested
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 14))
    assert compat.untested_torch() is None

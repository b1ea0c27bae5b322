"""A captured step costs no more than PyTorch's whole-step capture: counted, since equality cannot see a cost.

The recipe (``experiments/peers.py``, PyTorch's CUDA-graphs docs) captures
``zero_grad(set_to_none=True)``-fresh gradients, forward, loss, backward and
torch's foreach ``optimizer.step()``. Here the ops one call dispatches are
counted on CPU with a ``TorchDispatchMode``: for concur, the ops of the
captured body as the graph would hold them (:class:`EmulatedGraphs`), for
the recipe one step of the plain loop with ``foreach=True`` (torch's default
on CUDA). Ops that launch no kernel (views, detach) are left out.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import concur
import concur.training.capture as capture_mod
import concur.training.step as train_mod
from concur.training import snapshot as snapshot_mod
from tests.test_step_habits import graphs, loss_fn, make_batches, make_model  # noqa: F401 (graphs: a fixture)

NO_KERNEL = {"aten.detach", "aten.view", "aten.t", "aten._unsafe_view", "aten.alias", "aten.as_strided",
             "aten.expand", "aten.permute", "aten.transpose", "aten.unsqueeze", "aten.squeeze", "aten.reshape",
             "aten.slice", "aten.select", "aten.split", "aten.unbind", "aten.lift_fresh"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name not in NO_KERNEL and not name.startswith("profiler."):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


OPTIMIZERS = {
    "sgd_momentum": dict(lr=0.1, momentum=0.9),
    "sgd_decay": dict(lr=0.1, momentum=0.9, weight_decay=1e-4),
    "sgd_nesterov_decay": dict(lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True),
}
# Nesterov with weight decay: torch adds the decay into a temporary and the temporary into the parameters
# (two ops); the captured update, which makes no temporary, needs three (captured_optim._sgd_bucket).
ALLOWED_MORE = {"sgd_nesterov_decay": 1}


def recipe_ops(batches, options):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), foreach=True, **options)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    step(*batches[0])  # the first step makes the momentum buffers
    with CountOps() as counted:
        step(*batches[1])
    return counted.ops


def concur_ops(graphs, batches, options, streams, **kwargs):  # noqa: F811
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), **options)
    step = concur.train_step(model, loss_fn, opt, batches[0], streams=streams, cuda_graph=True, **kwargs)
    step(*batches[0])  # captures
    counted = CountOps()
    graphs.watch = lambda: counted
    step(*batches[1])
    assert graphs.captures == 1
    return counted.ops


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("streams", [1, 2])
def test_a_captured_step_dispatches_no_more_ops_than_the_recipe(graphs, name, streams):  # noqa: F811
    """Fails with gradients owned by the step (a zeroing and one add per parameter, 1 + 9 ops more here)."""
    batches = make_batches(3)
    ours, theirs = concur_ops(graphs, batches, OPTIMIZERS[name], streams), recipe_ops(batches, OPTIMIZERS[name])
    more = {k: v - theirs[k] for k, v in ours.items() if v > theirs[k]}
    assert sum(ours.values()) <= sum(theirs.values()) + ALLOWED_MORE.get(name, 0), more


def test_accumulation_costs_only_its_buffers_zeroing_and_adds(graphs):  # noqa: F811
    """With accumulate=2 each call adds into buffers the step owns (the graphs of all cycle positions and shapes
    share them): one zeroing per cycle and one add per parameter, the loss divided by k, nothing else."""
    batches = make_batches(3)
    options = OPTIMIZERS["sgd_momentum"]
    theirs = recipe_ops(batches, options)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), **options)
    step = concur.train_step(model, loss_fn, opt, batches[0], streams=1, cuda_graph=True, accumulate=2)
    step(*batches[0]), step(*batches[1])  # captures first and last position
    counted = CountOps()
    graphs.watch = lambda: counted
    step(*batches[0])
    n_params = len(list(model.parameters()))
    assert sum(counted.ops.values()) <= sum(theirs.values()) + 1 + n_params + 1


@pytest.mark.parametrize("kwargs, copies_weights", [
    ({}, False),
    ({"accumulate": 2}, True),  # warm-up adds into the owned buffers and steps: all of it is put back
    ({"before_step": lambda m, o: None}, True),  # before_step may touch parameters
])
def test_setup_copies_the_model_only_when_warm_up_changes_it(graphs, monkeypatch, kwargs, copies_weights):  # noqa: F811
    taken = []
    real = snapshot_mod.Snapshot

    def spy(*args, **kw):
        taken.append(real(*args, **kw))
        return taken[-1]

    monkeypatch.setattr(capture_mod, "Snapshot", spy)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = make_batches(2)
    step = concur.train_step(model, loss_fn, opt, batches[0], streams=1, cuda_graph=True, **kwargs)
    step(*batches[0])
    buffers = sum(b.numel() for b in model.buffers())
    params = sum(p.numel() for p in model.parameters())
    snapshot = taken[0]
    assert snapshot.weights is copies_weights
    assert (snapshot.saved_elements() >= buffers + params) is copies_weights


def test_setup_runs_the_model_only_on_the_warm_up_stream(monkeypatch):
    """Annotating the plan, trying the example batch, warm-up: all on one side stream, none on the caller's.

    The caching allocator keeps freed blocks per stream and cuBLAS a workspace
    per stream (32 MiB on an H100): a forward on the caller's stream at setup
    would hold a second set beside the warm-up's for as long as the step lives.
    """
    from tests.test_step_habits import EmulatedGraphs

    inside = [False]
    outside_forwards = []

    class OneSideStream(EmulatedGraphs):
        def side_stream(self):
            @contextlib.contextmanager
            def entered():
                inside[0] = True
                try:
                    yield
                finally:
                    inside[0] = False
            return entered()

        def capture(self, body, step):  # the capture stream and replays: the graph's own work, not setup's
            def allowed(fn):
                def run(*args):
                    inside[0] = True
                    try:
                        return fn(*args)
                    finally:
                        inside[0] = False
                return run
            graph, out = allowed(super().capture)(body, step)
            graph.replay = allowed(graph.replay)
            return graph, out

    runner = OneSideStream()
    monkeypatch.setattr(train_mod, "_graph_runner", lambda on_cuda, priority=False: runner)
    model = make_model()
    for m in (model, next(model.children())):  # the model (batch checks) and a layer (annotation, warm-up)
        m.register_forward_pre_hook(lambda m, args: None if inside[0] else outside_forwards.append(1))
    (x, y), = make_batches(1)
    for streams in (1, 2):
        outside_forwards.clear()
        step = concur.train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), (x, y),
                                 streams=streams)
        step(x, y)  # warm-up and capture
        assert runner.captures and not outside_forwards, streams
        del step

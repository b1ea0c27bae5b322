"""The annotation pass sees every kind of mutation and random draw, and leaves no trace."""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from concur.dag.annotate import RNG, annotate, statically_mutated_args
from concur.dag.hazards import operation_nodes
from concur.fx.trace import trace


class Mutations(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        a = x * 1.0
        a.add_(1)                 # method
        b = x * 2.0
        F.relu(b, True)           # positional inplace flag
        c = x * 3.0
        self.act(c)               # inplace module
        d = x * 4.0
        d += 1                    # operator.iadd (fx traces it as add)
        self.count.add_(1)        # buffer
        e = x * 5.0
        torch.clamp(e, 0, 1, out=e)  # out=
        return a + b + c + d + e


def _facts_by_target():
    gm = trace(Mutations())
    annotate(gm, (torch.randn(2, 3),))
    out = {}
    for n in operation_nodes(gm.graph):
        out.setdefault(str(n.target) if n.op != "call_function" else n.target.__name__, []).append(n.meta["concur"])
    return out


def test_every_inplace_form_writes_its_input():
    f = _facts_by_target()
    assert f["add_"][0].writes and f["add_"][1].writes   # a.add_ and self.count.add_
    assert f["relu"][0].writes
    assert f["act"][0].writes
    assert f["clamp"][0].writes
    assert not f["mul"][0].writes


def test_static_rules_cover_mutations_that_did_not_fire():
    gm = trace(Mutations())
    nodes = {n.name: n for n in gm.graph.nodes}
    mod = dict(gm.named_modules())
    assert statically_mutated_args(nodes["add_"], None) == [nodes["add_"].args[0]]
    assert statically_mutated_args(nodes["act"], mod["act"]) == [nodes["act"].args[0]]
    g = torch.fx.Graph()
    x = g.placeholder("x")
    setitem = g.call_function(operator.setitem, (x, 0, 1.0))
    assert statically_mutated_args(setitem, None) == [x]
    aten = g.call_function(torch.ops.aten.add_.Tensor, (x, x))
    assert x in statically_mutated_args(aten, None)


def test_random_draws_are_detected_in_train_mode_only():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    for training, expected in ((True, True), (False, False)):
        gm = trace(model.train(training))
        annotate(gm, (torch.randn(2, 4),))
        drop = [n for n in operation_nodes(gm.graph) if n.target == "1"][0]
        assert (RNG in drop.meta["concur"].writes) is expected


def test_annotation_restores_state_and_inputs():
    model = Mutations()
    gm = trace(model)
    x = torch.randn(2, 3)
    x_before = x.clone()
    rng = torch.random.get_rng_state()
    annotate(gm, (x,))
    assert model.count.item() == 0
    assert torch.equal(x, x_before)
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_flops_and_bytes_are_recorded():
    gm = trace(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()))
    annotate(gm, (torch.randn(1, 3, 10, 10),))
    conv = operation_nodes(gm.graph)[0].meta["concur"]
    assert conv.flops == 2 * 8 * 8 * 8 * 3 * 3 * 3
    assert conv.bytes_moved > 0 and conv.launches_kernel


class NoArithmetic(nn.Module):
    def __init__(self):
        super().__init__()
        self.skip = nn.Identity()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)                # a one-element counter: a launch, no work
        n = x.shape[0]                    # getattr, then getitem
        y = self.skip(x).view(n, -1)      # identity, view
        return torch.relu(y) + x.sum()    # real work


def test_ops_without_arithmetic_are_told_apart_from_work():
    gm = trace(NoArithmetic())
    annotate(gm, (torch.randn(4, 3),))
    facts = {n.name: n.meta["concur"] for n in operation_nodes(gm.graph)}
    assert {name for name, f in facts.items() if f.no_arithmetic} == {"add_", "getattr_1", "getitem", "skip", "view"}
    assert facts["add_"].launches_kernel  # still a kernel, just not one worth a stream


_seen_alive: list[int] = []
_probes: list = []


@torch.fx.wrap
def _probe(x):
    """Records how many earlier probed values are still alive when it runs (annotation frees dead values)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    _seen_alive.append(sum(not ref.expired() for ref in _probes))
    _probes.append(StorageWeakRef(x.untyped_storage()))
    return x


class Chain(nn.Module):
    def forward(self, x):
        for _ in range(8):
            x = _probe(x * 2.0)
        return x


def test_annotation_frees_each_value_after_its_last_use():
    """Annotating costs an inference run's memory, not every activation of the model at once."""
    _seen_alive.clear()
    _probes.clear()
    annotate(trace(Chain()), (torch.randn(64, 64),))
    assert len(_seen_alive) == 8
    assert max(_seen_alive) <= 2, _seen_alive  # kept alive, all 8 values would be: 0, 1, ..., 7


def test_storage_keys_tell_a_reused_address_from_an_alias():
    from concur.dag.annotate import StorageKeys

    key = StorageKeys()
    a = torch.empty(4096)
    first, view = key(a), key(a[10:])
    assert first == view  # a view shares its base's storage
    address = a.data_ptr()
    del a
    for _ in range(50):  # the allocator hands the freed block out again (usually at once)
        b = torch.empty(4096)
        if b.data_ptr() == address:
            assert key(b) != first
            break
        del b


def test_aliases_found_after_values_are_freed():
    """With values freed during the run, in-place writes through a view still hit the base's key."""
    class Views(nn.Module):
        def forward(self, x):
            for _ in range(4):
                y = x * 1.0  # dies after the next lines: its address is reused by the next iteration's
                y[0].add_(1)
                x = y + 1
            return x

    gm = trace(Views())
    annotate(gm, (torch.randn(8, 8),))
    nodes = operation_nodes(gm.graph)
    adds = [n for n in nodes if n.target == "add_"]
    muls = [n for n in nodes if n.target is operator.mul]
    assert len(adds) == 4 and len(muls) == 4
    for mul, add in zip(muls, adds):
        (made,) = mul.meta["concur"].outputs
        assert made in add.meta["concur"].writes
    assert len({next(iter(m.meta["concur"].outputs)) for m in muls}) == 4  # four storages, four keys

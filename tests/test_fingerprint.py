"""The model's fingerprint a captured step keys its graphs on (concur.training.fingerprint)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import concur
from concur.training import fingerprint as fingerprint_mod
from concur.training.fingerprint import ModelFingerprint
from tests.test_step_habits import graphs, loss_fn, make_batches, make_model  # noqa: F401 (graphs: a fixture)


class FlagAsProperty(nn.Linear):
    """A module whose train flag lives outside its ``__dict__``."""

    @property
    def training(self):
        return self.__dict__.get("_mode", True)

    @training.setter
    def training(self, mode):
        self.__dict__["_mode"] = mode


def fingerprint(model):
    return ModelFingerprint(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_equal_states_have_equal_numbers_and_a_state_seen_before_gets_its_number_back():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    fp = fingerprint(model)
    first = fp.state_id(())
    assert fp.state_id(()) == first and isinstance(first, int)
    model[1].eval()
    second = fp.state_id(())
    assert second != first
    model[1].train()
    assert fp.state_id(()) == first, "the first state again: its graphs are found again"
    assert fp.state_id(("lr", 0.2)) not in (first, second)


def test_past_the_states_kept_the_numbering_starts_over_and_no_number_stands_for_two_states(monkeypatch):
    monkeypatch.setattr(fingerprint_mod, "STATES_KEPT", 3)
    fp = fingerprint(nn.Linear(2, 2))
    numbers = [fp.state_id(("lr", i)) for i in range(7)]
    assert len(set(numbers)) == 7 and len(fp._states) <= 3
    assert fp.state_id(("lr", 0)) not in numbers, "forgotten: a new number, not one another state had"


def test_train_flags_kept_outside_the_modules_dict_are_read_as_attributes():
    model = nn.Sequential(nn.Linear(2, 2), FlagAsProperty(2, 2))
    fp = fingerprint(model)
    before = fp.state_id(())
    model[1].training = False  # only the property sees it
    assert fp.state_id(()) != before



def test_a_steps_graphs_are_keyed_on_the_states_number_not_on_the_state(graphs):  # noqa: F811 (a fixture)
    """Each lookup hashes the key: the state (a flag per module, a pointer per parameter) is numbered once."""
    model = make_model()
    step = concur.train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             make_batches(1)[0], streams=2)
    for x, y in make_batches(3):
        step(x, y)
    (key,) = step.graphs
    assert isinstance(key[2], int) and len(repr(key)) < 300


@pytest.fixture
def overwrite_params_on_conversion():
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    yield
    torch.__future__.set_overwrite_module_params_on_conversion(before)


def test_parameters_replaced_by_a_conversion_change_the_tree(overwrite_params_on_conversion):
    """torch.__future__'s overwrite_module_params_on_conversion: .double() puts new Parameters into the modules'
    dicts, with no registration hook to say so."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fp = fingerprint(model)
    assert not fp.tree_changed()
    old = model[0].weight
    model.double()
    assert model[0].weight is not old
    assert fp.tree_changed() and fp.tree[1][0] is model[0].weight
    assert not fp.tree_changed()

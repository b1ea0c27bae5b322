"""concur.api, the shim at the old home of optimize(): a checkpoint that names concur.api._rebuild still loads."""

from __future__ import annotations

import pickle

import torch

import concur
from tests.models import WideNet


def test_a_module_pickled_under_the_old_name_loads_and_computes_what_the_model_does():
    torch.manual_seed(0)
    model = WideNet(branches=3).eval()
    x = torch.randn(2, 3, 16, 16)
    data = pickle.dumps(concur.optimize(model, (x,), streams=2), protocol=2)
    new, old = b"cconcur.fx.module\n_rebuild\n", b"cconcur.api\n_rebuild\n"
    assert data.count(new) == 1
    loaded = pickle.loads(data.replace(new, old))
    assert type(loaded) is concur.ConcurModule
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)

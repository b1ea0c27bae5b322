"""concur.observe.tune_cache: results round-trip on disk, an entry of another format is a miss, clear counts."""

from __future__ import annotations

import json

import torch

from concur.observe.tune_cache import FORMAT, TunerCache, cache_key, clear_cache


def test_a_result_round_trips_and_an_entry_of_another_format_is_a_miss(tmp_path):
    cache = TunerCache(tmp_path)
    path = cache.put("k1", {"streams": 4, "scheduler": "fork"})
    assert path == tmp_path / "tuner" / "k1.json" and cache.get("k1") == {"streams": 4, "scheduler": "fork"}
    assert cache.get("missing") is None
    path.write_text(json.dumps({"format": FORMAT + 1, "result": {"streams": 8}}))
    assert cache.get("k1") is None  # a cache written by another concur is tuned again, not trusted
    cache.put("k2", {})
    assert [p.name for p in cache.entries()] == ["k1.json", "k2.json"]
    assert clear_cache(tmp_path) == 2 and cache.entries() == []


def test_the_key_ignores_parameter_values_and_follows_the_batch_shape():
    model = torch.nn.Linear(3, 2)
    key = cache_key(model, torch.zeros(4, 3), "NVIDIA H100")
    with torch.no_grad():
        model.weight.add_(1)
    assert cache_key(model, torch.zeros(4, 3), "NVIDIA H100") == key
    assert cache_key(model, torch.zeros(8, 3), "NVIDIA H100") != key

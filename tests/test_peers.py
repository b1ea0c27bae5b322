"""experiments/peers.py, the yardstick: free of concur, the eager recipe is the plain loop, graphs need CUDA.

And its wiring into experiments.sweep: the peer_* modes build their step through it, every row carries
the memory peaks, and the report divides by the peer where the run has its row.
"""

from __future__ import annotations

import ast
import copy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from experiments import peers
from experiments.sweep import measure, report
from experiments.sweep.configs import COMPILING_MODES, CUDA_MODES, group_configs, make_configs
from experiments.sweep.memory import FIELDS
from tests.conftest import requires_cuda

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "experiments" / "peers.py"


def _tiny() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    return model, torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))


def test_peers_imports_only_torch_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"torch"}
    imported = []
    for node in ast.walk(ast.parse(PEERS.read_text())):
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: a relative import in peers.py"
            imported.append(node.module or "")
    assert {name.split(".")[0] for name in imported} <= allowed, imported


def test_importing_peers_loads_no_concur_module():
    # not even indirectly: a fresh interpreter imports peers.py alone and lists what it loaded
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m == 'concur' or m.startswith(('concur.', 'experiments'))))")
    out = subprocess.run([sys.executable, "-c", code, str(PEERS)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_eager_recipe_is_the_plain_loop():
    model, x, y = _tiny()
    twin = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    step = peers.RECIPES["eager"](model, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), (x, y))
    opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        xi, yi = x + i, (y + i) % 3
        opt.zero_grad(set_to_none=True)
        expected = loss_fn(twin(xi), yi)
        expected.backward()
        opt.step()
        assert torch.equal(step(xi, yi), expected.detach())
    for got, want in zip(model.parameters(), twin.parameters()):
        assert torch.equal(got, want)
    assert step.recipe == "eager" and step.graph is None and step.trained_steps == 0


def test_the_compile_recipe_is_the_plain_loop_around_torch_compile(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m: compiled.append(m) or m)  # compiling itself is torch's to test
    model, x, y = _tiny()
    twin = copy.deepcopy(model)
    step = peers.compile_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), (x, y))
    eager = peers.eager_step(twin, nn.CrossEntropyLoss(), torch.optim.SGD(twin.parameters(), lr=0.1))
    assert compiled == [model]
    assert torch.equal(step(x, y), eager(x, y))


@pytest.mark.parametrize("recipe", ["eager_graph", "compile_graph"])
def test_the_graph_recipes_say_they_need_cuda(recipe):
    model, x, y = _tiny()
    with pytest.raises(RuntimeError, match=rf"peers\.{recipe}: .*CUDA device.*'eager' or 'compile' recipe"):
        peers.RECIPES[recipe](model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), (x, y))


def test_peer_modes_are_classified_and_built_through_peers(monkeypatch):
    assert {"peer_compile", "peer_compile_graph"} <= set(COMPILING_MODES)
    assert {"peer_eager_graph", "peer_compile_graph"} <= set(CUDA_MODES)
    assert not {"peer_eager", "peer_compile"} & set(CUDA_MODES)
    built = []
    real = peers.RECIPES["eager"]
    monkeypatch.setitem(peers.RECIPES, "eager", lambda *a: built.append(a) or real(*a))
    model, x = nn.Sequential(nn.Flatten(), nn.Linear(12, 10)), torch.randn(2, 3, 2, 2)
    y = torch.randint(0, 10, (2,))
    cfg = dict(model="m", batch=2, precision="fp32", mode="peer_eager", warmup=1)
    prepared = measure.prepare_mode(cfg, dict(cfg), model, x, y, None)
    [(got_model, loss_fn, opt, example, amp_dtype)] = built
    assert got_model is model and isinstance(loss_fn, nn.CrossEntropyLoss) and type(opt) is torch.optim.SGD
    assert example[0] is x and example[1] is y and amp_dtype is None
    assert prepared.train_step is None and prepared.row["setup_s"] >= 0


def test_peer_and_concur_modes_timed_together_share_one_child(tmp_path):
    args = types.SimpleNamespace(precisions=["bf16"], models=["m"], batches=[8], repeats=6, util_seconds=0,
                                 warmup=1, out=tmp_path, image_size=None, inject_failure=[],
                                 shared_compile_cache=False, compile_jobs=2, rounds=3,
                                 modes=["peer_compile_graph", "compile_graph", "fused:4"],
                                 together=["peer_compile_graph,compile_graph,fused:4"])
    groups = [[c["mode"] for c in g] for g in group_configs(make_configs(args))]
    assert groups == [["peer_compile_graph", "compile_graph", "fused:4"]]


def test_a_peer_row_carries_the_memory_peaks(tmp_path):
    """In-process, as a child runs it (the --cpu-smoke sweep in test_sweep.py checks the same through children)."""
    cfgs = [dict(model="branchy:2x8", batch=2, precision="fp32", mode=mode, repeats=2, warmup=1, image_size=16,
                 out=str(tmp_path), together="peer_eager,eager", rounds=1) for mode in ("peer_eager", "eager")]
    rows = measure.run_interleaved(cfgs)
    rows.append(measure.run_one(dict(cfgs[0], mode="peer_eager_graph")))
    rows = {r["mode"]: r for r in rows}
    cuda = torch.cuda.is_available()
    assert rows["peer_eager_graph"]["status"] == ("ok" if cuda else "skipped: no CUDA")
    for mode in ("peer_eager", "eager", "peer_eager_graph")[:3 if cuda else 2]:
        r = rows[mode]
        assert r["status"] == "ok" and r["ms"] > 0, r
        if cuda:  # reserved may not grow: a later mode's small tensors can fit in an earlier mode's segments
            assert r["setup_peak_allocated_mb"] > 0 and r["steady_peak_allocated_mb"] > 0, r
            assert r["setup_peak_reserved_mb"] >= 0 and r["steady_peak_reserved_mb"] >= 0, r
            assert r["peak_mb"] == r["setup_peak_allocated_mb"], r
        else:  # no allocator to ask
            assert all(field in r and r[field] is None for field in FIELDS), r
    assert rows["peer_eager"]["timed_with"] == ["eager"]
    summary = report.summary_markdown(list(rows.values()), dict(date="d", gpu="cpu", driver="-", torch="t"), [])
    assert "| setup MB | steady MB |" in summary


def _row(mode, ms, timed_with=(), **memory):
    return dict(model="g", precision="bf16", batch=8, mode=mode, status="ok", ms=ms, setup_s=10.0,
                timed_with=list(timed_with), **memory)


def test_the_report_divides_by_the_peer_and_never_calls_concurs_own_step_the_baseline():
    mem = dict(setup_peak_allocated_mb=100.0, setup_peak_reserved_mb=200.0, steady_peak_allocated_mb=50.0,
               steady_peak_reserved_mb=160.0)
    rows = [_row("peer_compile_graph", 3.0, ["compile_graph", "fused:4"], synced_ms=3.3, **mem),
            _row("compile_graph", 2.0, ["peer_compile_graph", "fused:4"], peak_mb=110.0),  # an older row
            _row("fused:4", 1.5, ["peer_compile_graph", "compile_graph"], synced_ms=2.0, setup_peak_allocated_mb=120.0,
                 setup_peak_reserved_mb=300.0, steady_peak_allocated_mb=40.0, steady_peak_reserved_mb=240.0),
            _row("peer_eager_graph", 4.0, **mem), _row("serial_graph", 5.0), _row("concur_graph:4", 3.2)]
    ratios = {e["mode"]: e for e in report.peer_ratios(rows)}
    assert {m: e["peer"] for m, e in ratios.items()} == {
        "compile_graph": "peer_compile_graph", "fused:4": "peer_compile_graph",
        "serial_graph": "peer_eager_graph", "concur_graph:4": "peer_eager_graph"}
    fused = ratios["fused:4"]
    assert fused["speedup"] == pytest.approx(2.0) and fused["together"]
    assert fused["synced_speedup"] == pytest.approx(1.65) and ratios["compile_graph"]["synced_speedup"] is None
    assert [fused[f + "_ratio"] for f in FIELDS] == pytest.approx([1.2, 1.5, 0.8, 1.5])
    assert ratios["compile_graph"]["setup_peak_allocated_mb_ratio"] == pytest.approx(1.1)  # peak_mb stands in
    assert ratios["compile_graph"]["steady_peak_reserved_mb_ratio"] is None
    assert not ratios["serial_graph"]["together"]
    # with a peer row at the point, concur's one-stream steps are no alternative
    [best] = report.best_speedups(rows)
    assert (best["concur_mode"], best["best_alternative"]) == ("fused:4", "peer_compile_graph")
    lines = report.peer_table_markdown(rows)
    assert "| g | bf16 | 8 | fused:4 | peer_compile_graph | 3.00 | 1.50 | 2.000x | 1.650x | 1.00x | 1.20x | 1.50x " \
           "| 0.80x | 1.50x |" in lines
    serial = next(line for line in lines if "| serial_graph |" in line)
    assert serial.startswith("| g | bf16 | 8 | serial_graph | peer_eager_graph (not together) | 4.00 | 5.00 | 0.800x |")


def test_no_setup_ratio_where_a_compile_reused_the_caches_of_its_child():
    rows = [_row("peer_compile_graph", 3.0, ["fused:4"], compile_cache="cold"),
            _row("fused:4", 1.5, ["peer_compile_graph"], compile_cache="warm: compiled after peer_compile_graph")]
    [entry] = report.peer_ratios(rows)
    assert entry["setup_ratio"] is None and entry["speedup"] == pytest.approx(2.0)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("recipe", ["eager_graph", "compile_graph"])
def test_the_graph_recipes_train_as_the_plain_loop(recipe):
    """The docs' warm-up trains 3 steps on the example batch; each replay is one more step of the plain loop."""
    model, x, y = _tiny()
    model, x, y = model.float().cuda(), x.float().cuda(), y.cuda()
    twin = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    step = peers.RECIPES[recipe](model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), (x, y))
    plain = peers.eager_step(twin, loss_fn, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9))
    for _ in range(step.trained_steps):
        plain(x, y)
    for i in range(1, 4):
        xi, yi = x + i, (y + i) % 3
        torch.testing.assert_close(step(xi, yi), plain(xi, yi))
    for got, want in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(got, want)
    assert step.graph is not None and step.trained_steps == 3

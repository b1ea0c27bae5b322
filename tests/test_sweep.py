"""experiments.sweep on CPU: the files, resume, failures as results, the synthetic nets, the bound."""

from __future__ import annotations

import json
import tempfile
import threading
import time
import types

import networkx as nx
import pytest
import torch

import concur
from concur.dag.annotate import NodeFacts
from experiments.sweep import children, measure, report
from experiments.sweep.bounds import NODE_RANGE, critical_path_bound
from experiments.sweep.cli import main
from experiments.sweep.configs import config_key, group_configs, make_configs
from experiments.sweep.memory import FIELDS as MEMORY_FIELDS
from experiments.sweep.rows import read_rows
from experiments.sweep_models import BranchyNet, build

META_KEYS = ("date", "gpu", "torch", "driver")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One smoke sweep: a real tiny net, an unknown model (raises), and a child that aborts."""
    out = tmp_path_factory.mktemp("sweep")
    args = ["--cpu-smoke", "--models", "branchy:2x8", "nosuch", "--modes", "eager", "eager_streams:2",
            "serial_graph", "--repeats", "2", "--out", str(out), "--inject-failure", "nosuch|2|fp32|eager=crash"]
    assert main(args) == 0
    return out, args


def test_smoke_sweep_writes_every_file_with_meta(smoke_run):
    out, _ = smoke_run
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 6
    for r in rows:
        assert all(r.get(k) for k in META_KEYS), r
    assert rows[0]["torch"] == torch.__version__
    assert not (out / "results.json").exists() and not (out / "results.csv").exists()  # the rows live once
    md = (out / "summary.md").read_text()
    assert torch.__version__ in md and rows[0]["date"] in md and "driver" in md
    from PIL import Image

    png = Image.open(out / "speedup_fp32.png")
    assert json.loads(png.text["Description"])["torch"] == torch.__version__


def test_cuda_modes_are_skipped_and_measured_modes_have_times(smoke_run):
    rows = {r["key"]: r for r in read_rows(smoke_run[0] / "results.jsonl")}
    assert rows["branchy:2x8|2|fp32|serial_graph"]["status"] == "skipped: no CUDA"
    for mode in ("eager", "eager_streams:2"):
        r = rows[f"branchy:2x8|2|fp32|{mode}"]
        assert r["status"] == "ok" and r["ms"] > 0 and r["setup_s"] >= 0
        # the memory peaks, allocated and reserved, setup and steady: every row has them, None without CUDA
        assert all(field in r and r[field] is None for field in MEMORY_FIELDS), r
    streams = rows["branchy:2x8|2|fp32|eager_streams:2"]
    # two branches: contention can only lower the ideal prediction, and neither beats 2x
    assert streams["streams_requested"] == 2 and 1.0 < streams["predicted_speedup"] <= streams["ideal_speedup"] <= 2.0
    assert "predicted_speedup" not in rows["branchy:2x8|2|fp32|eager"]  # no plan, no prediction


def test_failures_are_recorded_and_the_sweep_goes_on(smoke_run):
    rows = {r["key"]: r for r in read_rows(smoke_run[0] / "results.jsonl")}
    crashed = rows["nosuch|2|fp32|eager"]  # the child aborted: no row of its own, the parent wrote one
    assert crashed["status"] == "error" and "subprocess exited" in crashed["error"]
    raised = rows["nosuch|2|fp32|eager_streams:2"]
    assert raised["status"] == "error" and "unknown model" in raised["error"]
    assert "nosuch|2|fp32|eager" in (smoke_run[0] / "summary.md").read_text()


def test_resume_runs_only_what_is_missing(smoke_run, capsys):
    out, args = smoke_run
    jsonl = out / "results.jsonl"
    before = read_rows(jsonl)
    with pytest.raises(SystemExit, match="--resume"):  # never appends to an old run by accident
        main(args)
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    assert "launched 0 configuration(s)" in capsys.readouterr().err
    # Interrupted mid-write: the last row is lost and a cut line is left behind.
    lines = jsonl.read_text().splitlines()
    jsonl.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    assert main(args + ["--resume"]) == 0
    assert "launched 1 configuration(s)" in capsys.readouterr().err
    after = read_rows(jsonl)
    assert [r["started"] for r in after[:-1]] == [r["started"] for r in before[:-1]]
    assert after[-1]["key"] == before[-1]["key"]


@pytest.mark.parametrize("branches", [1, 3, 8, 16])
def test_branchy_net_has_the_requested_branch_count(branches):
    model, size = build(f"branchy:{branches}x8")
    assert all(len(block.branches) == branches for block in model.blocks)
    assert concur.inspect(model, (torch.randn(2, 3, 32, 32),)).width == branches


def test_nas_cell_net_traces_whole_and_is_branchy():
    model, size = build("nascell:8")
    info = concur.inspect(model, (torch.randn(2, 3, size, size),))
    assert not info.auto_leaves and info.width >= 4 and info.predicted_speedup[4] > 1.0


def test_bad_model_names_say_how_to_write_them():
    with pytest.raises(ValueError, match=r"branchy:<branches>x<width>"):
        build("branchy:eight")
    with pytest.raises(ValueError, match="1..16"):
        BranchyNet(17, 8)


def test_critical_path_bound_from_a_trace(tmp_path):
    """Diamond a -> (b, c) -> d -> e; kernels 1, 10, 5, 1 µs, e unmeasured: serial 17, longest path 12."""
    dag = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "e")])
    for node in dag:  # as on a plan's DAG; the roofline would give each node far more than its measured time
        dag.nodes[node]["facts"] = NodeFacts(frozenset(), frozenset(), frozenset(), 10**12, 10**12, True)
    events = []
    for i, (node, dur) in enumerate([("a", 1), ("b", 10), ("c", 5), ("d", 1)]):
        t = 100 * i
        events += [dict(ph="X", cat="user_annotation", name=NODE_RANGE + node, ts=t, dur=50),
                   dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=t + 5, dur=2,
                        args=dict(correlation=i)),
                   dict(ph="X", cat="kernel", name=f"k{node}", ts=t + 30, dur=dur, args=dict(correlation=i))]
    # A kernel launched outside any node range (e.g. the optimizer) is charged to no node.
    events.append(dict(ph="X", cat="kernel", name="stray", ts=999, dur=100, args=dict(correlation=99)))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    bound = critical_path_bound(path, types.SimpleNamespace(dag=dag))
    # e is not in the trace: it costs nothing (measured time only) and is counted out of the measured nodes
    assert (bound.serial_us, bound.critical_path_us) == (17.0, 12.0)
    assert (bound.nodes_measured, bound.nodes_total) == (4, 5)
    assert bound.bound_speedup == pytest.approx(17 / 12)


def test_best_speedup_compares_concur_modes_with_alternatives():
    rows = [dict(model="m", precision="fp32", batch=8, mode=mode, status="ok", ms=ms)
            for mode, ms in [("eager", 10.0), ("compile_graph", 4.0), ("concur_graph:4", 3.0), ("fused:4", 2.0)]]
    [best] = report.best_speedups(rows)
    assert (best["concur_mode"], best["best_alternative"], best["speedup"]) == ("fused:4", "compile_graph", 2.0)


def test_modes_that_compile_get_a_child_each_and_the_rest_share_one():
    cfgs = [dict(model=m, batch=8, precision="fp32", mode=mode)
            for m in ("a", "b") for mode in ("eager", "serial_graph", "compile", "fused:4", "critical_path")]
    groups = [[c["model"] + "|" + c["mode"] for c in g] for g in group_configs(cfgs)]
    assert groups == [["a|eager", "a|serial_graph"], ["a|compile"], ["a|fused:4"], ["a|critical_path"],
                      ["b|eager", "b|serial_graph"], ["b|compile"], ["b|fused:4"], ["b|critical_path"]]


@pytest.mark.parametrize("shared", [False, True])
def test_compiling_modes_start_from_empty_compile_caches_unless_asked(shared, monkeypatch, tmp_path):
    args = types.SimpleNamespace(precisions=["fp32"], models=["m"], batches=[8], modes=["eager", "compile"],
                                 repeats=1, util_seconds=0, warmup=0, out=tmp_path, image_size=None,
                                 inject_failure=[], shared_compile_cache=shared)
    eager, compiling = make_configs(args)
    assert "compile_cache" not in eager and compiling["compile_cache"] == ("shared" if shared else "cold")
    seen = []

    def fake_child(flag, cfg, timeout_s, extra_env=None):
        seen.append(extra_env)
        return json.dumps(dict(cfg, key=config_key(cfg), status="ok")) + "\n", None

    monkeypatch.setattr(children, "_run_child", fake_child)
    assert children.run_in_subprocess(compiling, 10, {})["status"] == "ok"
    if shared:
        assert seen == [None]
    else:
        [env] = seen
        assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(tempfile.gettempdir()) and "triton" in env["TRITON_CACHE_DIR"]


def test_fused_rows_record_what_the_backend_made_of_each_graph():
    torch.manual_seed(0)
    model = BranchyNet(branches=4, width=8, blocks=1)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    step = concur.train_step(model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                             (x, y), streams=1, compile=True)
    step(x, y)
    graphs = measure.compiled_graphs(step)
    assert [(g["backward"], g["strategy"], g["streams"], g["waits"], g["fallback"]) for g in graphs] == \
        [(False, "kernels", 1, 0, None), (True, "kernels", 1, 0, None)]


@pytest.mark.parametrize("mode, options, priority", [
    ("fused:4", None, True), ("fused_reuse:4", {"buffer_reuse": True}, True),
    ("fused_ordered:4", {"buffer_reuse": "ordered"}, True),
    ("fused_nosplit:4", {"split_weight_grads": False}, True), ("fused_noprio:4", None, False),
    ("fused_gate105:4", {"min_predicted_speedup": 1.05}, True),
    ("compile_graph", None, True)])
def test_fused_variants_reach_train_step_with_their_options(mode, options, priority, monkeypatch):
    seen = {}

    def fake_train_step(model, loss_fn, opt, batch, **kwargs):
        seen.update(kwargs)
        return lambda x, y: None

    monkeypatch.setattr(concur, "train_step", fake_train_step)
    model, x, y = BranchyNet(branches=2, width=4, blocks=1), torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    cfg = dict(model="branchy:2x4", batch=2, precision="fp32", mode=mode, warmup=0)
    measure.prepare_mode(cfg, dict(cfg), model, x, y, None)
    assert seen["compile"] is True and seen["compile_options"] == options and seen["stream_priority"] is priority
    assert seen["streams"] == (1 if mode == "compile_graph" else 4)


def test_an_unfused_step_decides_on_its_first_calls_alone_on_the_gpu_before_its_warm_up(monkeypatch):
    """prepare_mode calls a step whose first calls time its programs (TrainStep.deciding) until it has decided,
    holding the GPU turn exclusively meanwhile, then warms up the program it kept."""
    events = []

    class DecidingStep:
        calls = 0

        @property
        def deciding(self):
            return self.calls < 7

        def __call__(self, x, y):
            self.calls += 1
            events.append("call")

    class Turn:
        def exclusive(self):
            events.append("exclusive")

        def shared(self):
            events.append("shared")

    monkeypatch.setattr(concur, "train_step", lambda *a, **k: DecidingStep())
    model, x, y = BranchyNet(branches=2, width=4, blocks=1), torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    cfg = dict(model="branchy:2x4", batch=2, precision="fp32", mode="concur_graph:4", warmup=2)
    measure.prepare_mode(cfg, dict(cfg), model, x, y, None, Turn())
    assert events == ["call", "exclusive"] + ["call"] * 6 + ["shared"] + ["call"] * 2


def test_zoo_models_are_built_at_their_own_input_size():
    model, size = build("torchvision:resnet18")
    assert type(model).__name__ == "ResNet" and size == 224


def test_a_crash_inside_a_group_loses_only_its_own_row(tmp_path):
    args = ["--cpu-smoke", "--models", "branchy:2x8", "--modes", "eager", "eager_streams:2", "serial_graph",
            "--repeats", "2", "--out", str(tmp_path), "--inject-failure", "branchy:2x8|2|fp32|eager_streams:2=crash"]
    assert main(args) == 0
    rows = {r["key"]: r for r in read_rows(tmp_path / "results.jsonl")}
    assert rows["branchy:2x8|2|fp32|eager"]["status"] == "ok"
    assert "subprocess exited" in rows["branchy:2x8|2|fp32|eager_streams:2"]["error"]
    assert rows["branchy:2x8|2|fp32|serial_graph"]["status"] == "skipped: no CUDA"  # ran after the crash


def _plotted(monkeypatch) -> list[dict]:
    """Record what each figure saved through report.save_figure shows: lines and bars by label."""
    shown = []
    real_save = report.save_figure

    def recording_save(fig, path, meta):
        [ax] = fig.axes
        shown.append(dict(
            path=path.name,
            lines={ln.get_label(): list(zip(ln.get_xdata(), ln.get_ydata())) for ln in ax.get_lines()
                   if not ln.get_label().startswith("_")},
            bars={c.get_label(): [round(b.get_height(), 6) for b in c] for c in ax.containers}))
        return real_save(fig, path, meta)

    monkeypatch.setattr(report, "save_figure", recording_save)
    return shown


def test_utilization_timelines_and_bound_plots_from_saved_rows(tmp_path, monkeypatch):
    from PIL import Image

    import concur.observe.report
    from concur.observe.monitor import Mark, MonitorRecord, Sample, UtilizationSample

    rows = []
    for mode, busy in (("serial_graph", 60.0), ("concur_graph:4", 90.0)):
        rec = MonitorRecord(available=True, device="fake", duration_s=2.0,
                            samples=[Sample(t / 10, 1000.0, 1980.0, 300.0) for t in range(20)],
                            utilization=[UtilizationSample(t / 5, busy if t >= 5 else 0.0) for t in range(10)],
                            marks=[Mark(0.0, "setup"), Mark(1.0, "timed steps")])
        rows.append(dict(model="m", precision="fp32", batch=8, mode=mode, status="ok", ms=2.0 if busy > 80 else 3.0,
                         util_timeline=str(rec.save(tmp_path / f"{busy}.json"))))
    rows.append(dict(model="m", precision="fp32", batch=8, mode="critical_path", status="ok", fwd_serial_us=100.0,
                     fwd_critical_path_us=50.0, bound_speedup=2.0))
    meta = dict(date="d", gpu="g", driver="v", torch="t")
    merged = []
    real_plot = concur.observe.report.plot_utilization
    monkeypatch.setattr(concur.observe.report, "plot_utilization", lambda rec, *a: merged.append(rec) or real_plot(rec, *a))
    shown = _plotted(monkeypatch)
    paths = report.plot_utilization_timelines(rows, meta, tmp_path) + report.plot_bounds(rows, meta, tmp_path)
    assert sorted(p.name for p in paths) == ["bound.png", "util_m_fp32_b8.png"]
    assert report.bound_rows(rows)[0]["achieved_speedup"] == pytest.approx(1.5)
    # the bound plot: 2.0x possible, 1.5x achieved (serial 3 ms / concur 2 ms); the run's meta in the PNG
    [bound] = shown
    assert bound["bars"] == {"bound (forward critical path)": [2.0], "achieved (whole step)": [1.5]}
    assert json.loads(Image.open(tmp_path / "bound.png").text["Description"]) == meta
    # the timeline: each mode's timed phase (from 1.0 s of its own record) one after the other, by mode name
    [record] = merged
    assert [(m.t_s, m.label) for m in record.marks] == [(0.0, "concur_graph:4"), (1.0, "serial_graph")]
    assert record.duration_s == 2.0 and len(record.samples) == 20
    busy = {round(u.t_s, 6): u.gpu_percent for u in record.utilization if u.t_s >= 0}
    assert busy[0.0] == 90.0 and busy[1.0] == 60.0


def test_compile_jobs_run_children_side_by_side_after_what_must_run_alone(monkeypatch, tmp_path):
    args = types.SimpleNamespace(precisions=["fp32"], models=["m"], batches=[8, 16],
                                 modes=["critical_path", "eager", "compile", "fused:4"], repeats=1, util_seconds=0,
                                 warmup=0, out=tmp_path, image_size=None, inject_failure=[],
                                 shared_compile_cache=False, compile_jobs=2)
    configs = make_configs(args)
    # the bound profiles kernels one by one: nothing may run beside it
    assert [bool(c.get("gpu_lock")) for c in configs] == [False, True, True, True] * 2
    running, events, lock = [], [], threading.Lock()

    def fake_group(group, timeout_s, meta):
        with lock:
            running.append(group[0]["mode"])
            events.append((group[0]["mode"], len(running)))
        time.sleep(0.2)
        with lock:
            running.remove(group[0]["mode"])
        return [dict(c, key=config_key(c), status="ok") for c in group]

    monkeypatch.setattr(children, "run_group_in_subprocess", fake_group)
    rows, launched = children.run_sweep(configs, tmp_path, resume=False, timeout_s=10)
    assert launched == 8 and sorted(r["key"] for r in rows) == sorted(config_key(c) for c in configs)
    assert [m for m, _ in events[:2]] == ["critical_path", "critical_path"]  # what times alone runs first, alone
    assert max(n for m, n in events if m == "critical_path") == 1
    assert max(n for m, n in events if m != "critical_path") == 2  # the rest overlap, two at a time


def test_memory_waves_keep_the_largest_children_apart():
    def group(batch, precision, modes=2):
        return [dict(batch=batch, precision=precision, mode=f"m{i}") for i in range(modes)]

    groups = [group(b, p) for p in ("fp32", "bf16") for b in (8, 32, 64, 128)] * 3
    waves = children.memory_waves(groups, jobs=6)
    assert sorted(map(id, (g for w in waves for g in w))) == sorted(map(id, groups))  # each group once
    assert all(len(w) <= 6 for w in waves)
    size = lambda g: g[0]["batch"] * len(g) * (1 if g[0]["precision"] == "bf16" else 2)  # noqa: E731
    assert all(sum(map(size, w)) <= children.WAVE_CAPACITY_PER_80GB for w in waves)
    assert max(sum(1 for g in w if g[0]["batch"] == 128 and g[0]["precision"] == "fp32") for w in waves) == 3
    # a resumed sweep of small batches is not held to a third of its own largest child
    small = [group(64, "bf16") for _ in range(8)]
    assert [len(w) for w in children.memory_waves(small, jobs=8)] == [8]
    # a child larger than the capacity still runs, alone
    huge = [group(1024, "fp32"), group(8, "bf16")]
    assert [len(w) for w in children.memory_waves(huge, jobs=8)] == [1, 1]


def test_gpu_turns_share_while_compiling_and_time_alone(tmp_path):
    import fcntl

    path = str(tmp_path / ".gpu.lock")
    first, second = children.GpuTurn(path), children.GpuTurn(path)
    first.shared()
    second.shared()  # two children compile side by side
    with open(path) as probe:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody times while they compile
        second.release()
        first.exclusive()
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # nor compiles while one times
        first.release()
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    children.GpuTurn(None).exclusive()  # without --compile-jobs: no lock at all


def test_fp32_channels_last_precision_runs_the_model_channels_last(tmp_path, monkeypatch):
    layouts = []

    def spying_build(name):
        model, size = build(name)
        model.register_forward_pre_hook(lambda m, args: layouts.append(
            args[0].is_contiguous(memory_format=torch.channels_last)))
        return model, size

    monkeypatch.setattr("experiments.sweep_models.build", spying_build)
    for precision in ("fp32", "fp32-cl"):
        row = measure.run_one(dict(model="branchy:2x8", batch=2, precision=precision, mode="eager", repeats=1,
                                 warmup=0, image_size=16, out=str(tmp_path)))
        assert row["status"] == "ok", row
    assert layouts[0] is False and layouts[-1] is True


def _args(tmp_path, modes, together, compile_jobs=1):
    return types.SimpleNamespace(precisions=["fp32"], models=["m"], batches=[8], modes=modes, repeats=6,
                                 util_seconds=0, warmup=1, out=tmp_path, image_size=None, inject_failure=[],
                                 shared_compile_cache=False, compile_jobs=compile_jobs, together=together,
                                 rounds=3)


def test_modes_timed_together_share_one_child_in_the_order_given(tmp_path):
    args = _args(tmp_path, ["eager", "fused:4", "serial_graph", "compile_graph", "concur_graph:4"],
                 ["compile_graph,fused:4", "serial_graph,concur_graph:4"], compile_jobs=4)
    configs = make_configs(args)
    groups = [[c["mode"] for c in g] for g in group_configs(configs)]
    assert groups == [["eager"], ["compile_graph", "fused:4"], ["serial_graph", "concur_graph:4"]]
    by_mode = {c["mode"]: c for c in configs}
    assert by_mode["fused:4"]["together"] == "compile_graph,fused:4" and by_mode["fused:4"]["rounds"] == 3
    # with --compile-jobs every child takes turns on the GPU through one lock
    assert len({c["gpu_lock"] for c in configs}) == 1
    assert by_mode["compile_graph"]["compile_cache"] == "cold" and "compile_cache" not in by_mode["serial_graph"]


@pytest.mark.parametrize("together", [["eager"], ["eager,nosuch"], ["eager,eager_streams:2", "eager,serial_graph"]])
def test_bad_together_sets_are_refused(together, tmp_path, capsys):
    args = ["--cpu-smoke", "--out", str(tmp_path), *[a for t in together for a in ("--together", t)]]
    with pytest.raises(SystemExit):
        main(args)
    assert "--together" in capsys.readouterr().err


def test_modes_timed_together_take_turns_and_later_compiles_say_their_cache_was_warm(monkeypatch, tmp_path):
    calls = []

    def fake_prepare(cfg, row, model, x, y, amp_dtype, turn=None):
        row["setup_s"] = 0.0
        if cfg["mode"] == "compile":
            raise RuntimeError("inductor said no")
        return measure.PreparedMode(row, lambda: calls.append(cfg["mode"]), None, model, x, cuda=False)

    monkeypatch.setattr(measure, "prepare_mode", fake_prepare)
    monkeypatch.setattr(measure, "model_and_batch", lambda cfg, device: (None, None, None, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    modes = ["eager", "compile", "eager_streams:2"]
    cfgs = make_configs(_args(tmp_path, modes, [",".join(modes)]))
    rows = {r["mode"]: r for r in measure.run_interleaved(cfgs)}
    assert rows["compile"]["status"] == "error" and "inductor said no" in rows["compile"]["error"]
    assert "compile_cache" not in rows["eager_streams:2"] or "warm" not in rows["eager_streams:2"]["compile_cache"]
    for mode in ("eager", "eager_streams:2"):  # the failed mode does not stop the others
        r = rows[mode]
        assert r["status"] == "ok" and r["ms"] >= 0 and r["rounds"] == 3 and r["timed_with"] == \
            [m for m in modes if m != mode]
    # 3 rounds of (2 re-warm + 6 // 3 timed) steps each, alternating: drift reaches both modes alike
    assert calls == (["eager"] * 4 + ["eager_streams:2"] * 4) * 3


def test_a_second_compile_in_a_together_set_is_marked_warm(monkeypatch, tmp_path):
    monkeypatch.setattr(measure, "prepare_mode", lambda cfg, row, *a: measure.PreparedMode(
        row, lambda: None, None, None, None, cuda=False))
    monkeypatch.setattr(measure, "model_and_batch", lambda cfg, device: (None, None, None, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # so the CUDA modes are not skipped
    monkeypatch.setattr(measure, "time_in_turns", lambda prepared, cfg: None)
    cfgs = make_configs(_args(tmp_path, ["fused:4", "compile_graph", "serial_graph"],
                                    ["fused:4,compile_graph,serial_graph"]))
    rows = {r["mode"]: r for r in measure.run_interleaved(cfgs)}
    assert rows["fused:4"]["compile_cache"] == "cold"
    assert rows["compile_graph"]["compile_cache"] == "warm: compiled after fused:4 in the same process"
    assert "compile_cache" not in rows["serial_graph"]


def test_a_together_sweep_on_cpu_times_both_modes_in_one_child(tmp_path):
    args = ["--cpu-smoke", "--models", "branchy:2x8", "--modes", "eager", "eager_streams:2", "--repeats", "4",
            "--together", "eager,eager_streams:2", "--rounds", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = {r["mode"]: r for r in read_rows(tmp_path / "results.jsonl")}
    assert set(rows) == {"eager", "eager_streams:2"}
    for mode, r in rows.items():
        assert r["status"] == "ok" and r["ms"] > 0 and r["rounds"] == 2 and r["torch"] == torch.__version__, r
    assert rows["eager_streams:2"]["predicted_speedup"] > 1.0


def test_rows_keep_concurs_warnings_from_the_setup(tmp_path, monkeypatch):
    """A fallback train_step warns about (say, 4 streams -> 1) must show in the row, not only on stderr."""
    import warnings

    real_train_step = concur.train_step

    def warning_train_step(*args, **kwargs):
        warnings.warn("concur.train_step: built with a caveat")
        step = real_train_step(*args, **kwargs)

        def first_step_warns(*a):
            warnings.warn("concur.train_step: capturing the step with 2 stream(s) failed; falling back")
            warnings.warn("some other library's warning")
            return step(*a)
        first_step_warns.requested_streams, first_step_warns.graphs, first_step_warns.backends = 2, {}, {}
        return first_step_warns

    monkeypatch.setattr(concur, "train_step", warning_train_step)
    row = measure.run_one(dict(model="branchy:2x8", batch=2, precision="fp32", mode="eager_streams:2", repeats=1,
                             warmup=0, image_size=16, out=str(tmp_path)))
    assert row["status"] == "ok", row
    assert row["warnings"] == ["concur.train_step: built with a caveat",
                               "concur.train_step: capturing the step with 2 stream(s) failed; falling back"]
    plain = measure.run_one(dict(model="branchy:2x8", batch=2, precision="fp32", mode="eager", repeats=1,
                               warmup=0, image_size=16, out=str(tmp_path)))
    assert plain["warnings"] == []


def test_a_mode_that_fails_to_be_described_keeps_its_timing(monkeypatch, tmp_path):
    """Describing (concur's analysis on the GPU) runs after the timing; its failure must not discard the times."""
    def out_of_memory_inside_shape_prop(p):
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("ShapeProp error for: node=%conv") from exc

    monkeypatch.setattr(measure, "describe_mode", out_of_memory_inside_shape_prop)
    cfgs = make_configs(_args(tmp_path, ["eager", "eager_streams:2"], ["eager,eager_streams:2"]))
    for cfg in cfgs:
        cfg.update(model="branchy:2x8", batch=2, image_size=16)
    rows = measure.run_interleaved(cfgs)
    single = measure.run_one(dict(cfgs[0], repeats=1, warmup=0))
    for r in rows + [single]:
        assert r["status"] == "ok" and r["ms"] > 0, r
        assert r["describe_error"].startswith("OutOfMemoryError: CUDA out of memory"), r["describe_error"]
        assert "raised as RuntimeError: ShapeProp error" in r["describe_error"]


def test_error_rows_name_the_root_cause_of_a_wrapped_exception():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("ShapeProp error for: node=%conv") from exc
    except RuntimeError as exc:
        fields = measure.error_fields(exc)
    assert fields["status"] == "error"
    assert fields["error"] == "OutOfMemoryError: CUDA out of memory (raised as RuntimeError: ShapeProp error for: node=%conv)"
    try:
        raise ValueError("plain")
    except ValueError as exc:
        assert measure.error_fields(exc)["error"] == "ValueError: plain"


def test_combine_makes_one_run_of_parts_and_never_overwrites_a_measured_run(tmp_path, capsys):
    def part(name, rows):
        d = tmp_path / name
        d.mkdir()
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    def row(mode, ms, date):
        return dict(key=f"m|8|fp32|{mode}", model="m", batch=8, precision="fp32", mode=mode, status="ok", ms=ms,
                    iqr_ms=0.1, date=date, gpu="H100", driver="1", torch="2.11")

    first = part("day1", [row("eager", 9.0, "2026-11-22"), row("serial_graph", 5.0, "2026-11-22")])
    second = part("day2", [row("serial_graph", 4.0, "2026-11-23"), row("fused:4", 2.0, "2026-11-23")])
    out = tmp_path / "full"
    assert main(["--combine", str(first), str(second), "--out", str(out)]) == 0
    rows = {r["mode"]: r for r in read_rows(out / "results.jsonl")}
    assert {m: (r["ms"], r["date"], r["source"]) for m, r in rows.items()} == {
        "eager": (9.0, "2026-11-22", str(first)), "serial_graph": (4.0, "2026-11-23", str(second)),
        "fused:4": (2.0, "2026-11-23", str(second))}
    summary = (out / "summary.md").read_text()
    assert f"- `{first}`: 1 rows, 2026-11-22" in summary and "2026-11-22 + 2026-11-23" in summary
    assert main(["--combine", str(first), "--out", str(out)]) == 0  # a union may be redone
    assert len(read_rows(out / "results.jsonl")) == 2
    with pytest.raises(SystemExit):  # not into the default run directory
        main(["--combine", str(first)])
    assert "--combine needs --out" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="holds measured rows"):
        main(["--combine", str(first), "--out", str(second)])
    assert len(read_rows(second / "results.jsonl")) == 2  # untouched


def test_the_mode_table_puts_every_mode_side_by_side():
    def row(model, batch, mode, ms=None, status="ok"):
        return dict(model=model, precision="bf16", batch=batch, mode=mode, status=status, ms=ms)

    rows = [row("g", 8, "compile_graph", 3.0), row("g", 8, "fused:4", 2.5), row("g", 8, "eager", 20.0),
            row("g", 64, "compile_graph", 9.0), row("g", 64, "fused:4", status="error"),
            row("g", 64, "critical_path", 0.0)]
    lines = report.mode_table_markdown(rows)
    assert lines[3] == "| model | precision | batch | eager | compile_graph | fused:4 | best concur / best alternative |"
    assert lines[5] == "| g | bf16 | 8 | 20.00 | 3.00 | 2.50 | 1.20x (fused:4 / compile_graph) |"
    assert lines[6] == "| g | bf16 | 64 | - | 9.00 | error |  |"
    assert report.mode_table_markdown([]) == []


def test_memory_peaks_count_from_the_modes_own_start_and_not_the_other_modes(monkeypatch):
    """Setup: peaks beyond what was held before it. Steady: held after setup + the largest rise over timed steps."""
    from experiments.sweep.memory import MemoryPeaks

    mb = 2**20
    state = dict(allocated=1000 * mb, reserved=2000 * mb, max_allocated=0, max_reserved=0)

    def reset():
        state.update(max_allocated=state["allocated"], max_reserved=state["reserved"])

    for name, fn in dict(synchronize=lambda: None, empty_cache=lambda: None, reset_peak_memory_stats=reset,
                         memory_allocated=lambda: state["allocated"], memory_reserved=lambda: state["reserved"],
                         max_memory_allocated=lambda: state["max_allocated"],
                         max_memory_reserved=lambda: state["max_reserved"]).items():
        monkeypatch.setattr(torch.cuda, name, fn)
    memory, row = MemoryPeaks(cuda=True), {}
    memory.begin_setup()
    state.update(max_allocated=1500 * mb, max_reserved=3000 * mb, allocated=1200 * mb, reserved=2500 * mb)
    memory.end_setup(row)
    assert (row["setup_peak_allocated_mb"], row["setup_peak_reserved_mb"], row["peak_mb"]) == (500, 1000, 500)
    state.update(allocated=1700 * mb, reserved=3300 * mb)  # another mode of the child set up meanwhile
    for rise in (150, 200, 100):  # three rounds of timed steps
        memory.begin_steps()
        state.update(max_allocated=(1700 + rise) * mb, max_reserved=(3300 + rise // 2) * mb)
        memory.end_steps()
    memory.record_steady(row)
    assert (row["steady_peak_allocated_mb"], row["steady_peak_reserved_mb"]) == (200 + 200, 500 + 100)
    without = {}
    MemoryPeaks(cuda=False).end_setup(without)
    assert without == {}


def test_turns_time_back_to_back_steps_and_waited_steps_apart(monkeypatch):
    """``ms`` is the median of per-round means of back-to-back steps; ``synced_ms`` of steps each waited for."""
    import concur.observe.timing as timing_mod
    from experiments.sweep import timing

    blocks = iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0])  # rounds alternate: mode a, mode b, a, b, a, b
    monkeypatch.setattr(timing_mod, "cuda_block_ms", lambda fn, warmup, steps: next(blocks))
    monkeypatch.setattr(timing_mod, "cuda_times_ms", lambda fn, warmup, repeats: [10.0] * repeats)
    monkeypatch.setattr(timing, "_under_nvml", lambda row, cfg, fn, seconds, first=lambda: None: None)
    memory = types.SimpleNamespace(begin_steps=lambda: None, end_steps=lambda: None, record_steady=lambda row: None)
    prepared = [types.SimpleNamespace(row={}, step_fn=lambda: None, cuda=True, memory=memory) for _ in range(2)]
    timing.time_in_turns(prepared, {"rounds": 3, "repeats": 12})
    assert [p.row["ms"] for p in prepared] == [3.0, 5.0]
    assert [p.row["synced_ms"] for p in prepared] == [10.0, 10.0]


def test_the_sweeps_timing_does_not_import_its_measure():
    """timing.py steps what measure.py prepares: the import runs one way (measure -> timing), never back."""
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "experiments" / "sweep" / "timing.py").read_text()
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert "experiments.sweep.measure" not in imported

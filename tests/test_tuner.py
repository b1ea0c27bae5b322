"""The measured tuner on synthetic step-time curves with a fake timer and clock; its cache and key."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
import torch.nn as nn

import concur
from concur.observe import tuner
from concur.observe.tuner import Config, Measurement, TuneResult, TunerCache, beats, cache_key, clear_cache, tune
from tests.fixtures.fake_nvml import FakeClock
from tests.models import WideNet


class Curve:
    """``measure`` for :func:`tune`: step time per configuration from a table; each trial costs fake time."""

    def __init__(self, times: dict, iqr: float = 0.02, repeats: int = 20, trial_s: float = 2.0,
                 clock: FakeClock | None = None, fail: tuple = ()):
        self.times, self.iqr, self.repeats, self.trial_s = times, iqr, repeats, trial_s
        self.clock = clock or FakeClock()
        self.fail = fail
        self.calls: list[Config] = []

    def __call__(self, config: Config) -> Measurement:
        self.calls.append(config)
        self.clock.advance(self.trial_s)
        if config in self.fail or config.streams in self.fail:
            raise RuntimeError("CUDA out of memory (planted)")
        key = config if config in self.times else config.streams
        return Measurement(self.times[key], self.iqr, self.repeats)


def run(curve: Curve, **kw) -> TuneResult:
    kw.setdefault("progress", False)
    return tune(curve, clock=curve.clock, **kw)


SATURATING = {1: 5.0, 2: 4.4, 3: 4.0, 4: 3.8, 5: 3.79, 6: 3.8, 7: 3.85, 8: 3.9}


def test_picks_the_knee_of_a_saturating_curve_and_stops_after_it():
    curve = Curve(SATURATING)
    result = run(curve)
    assert result.config == Config(4, "critical_path")
    assert result.measurement.median_ms == 3.8 and result.baseline.median_ms == 5.0
    assert result.speedup == pytest.approx(5.0 / 3.8)
    # 1..5 on the primary scheduler (5 does not beat 4), then fork at 4; never 6, 7, 8.
    assert curve.calls == [Config(k) for k in range(1, 6)] + [Config(4, "fork")]
    assert "5 streams did not beat 4" in result.stopped


def test_no_gain_keeps_serial_and_stops_at_two_streams():
    curve = Curve({1: 5.0, 2: 5.01, 3: 4.2})
    result = run(curve, schedulers=("critical_path",))
    assert result.config == Config(1) and result.speedup == 1.0
    assert [c.streams for c in curve.calls] == [1, 2]


def test_never_slower_than_serial_even_when_every_stream_count_is():
    curve = Curve({1: 5.0, 2: 5.5, 3: 6.0, "fork": 5.2})
    curve.times[Config(2, "fork")] = 5.3
    result = run(curve, patience=3)
    assert result.config.streams == 1 and result.measurement.median_ms == 5.0
    assert len(result.trials) == 5  # 1, 2, 3, 4 (=3 misses), then fork at 2 (closest)


def test_a_gain_within_the_noise_keeps_fewer_streams():
    times = {1: 5.0, 2: 4.0, 3: 3.94, 4: 3.93}
    noisy = run(Curve(times, iqr=0.5, repeats=20), min_gain=0.0, schedulers=("critical_path",))
    quiet = run(Curve(times, iqr=0.001, repeats=20), min_gain=0.0, schedulers=("critical_path",))
    assert noisy.config.streams == 2
    assert quiet.config.streams == 4


def test_min_gain_floor_ignores_sub_percent_gains_even_without_noise():
    times = {1: 5.0, 2: 4.0, 3: 3.98, 4: 3.97}
    assert run(Curve(times, iqr=0.0), schedulers=("critical_path",)).config.streams == 2
    assert run(Curve(times, iqr=0.0), min_gain=0.0, schedulers=("critical_path",)).config.streams == 4


def test_the_other_scheduler_wins_only_when_it_beats_the_best_beyond_noise():
    faster = dict(SATURATING)
    faster[Config(4, "fork")] = 3.5
    assert run(Curve(faster)).config == Config(4, "fork")
    close = dict(SATURATING)
    close[Config(4, "fork")] = 3.79
    assert run(Curve(close)).config == Config(4, "critical_path")


def test_a_failed_trial_is_recorded_and_counts_as_no_gain():
    result = run(Curve(SATURATING, fail=(3,)), schedulers=("critical_path",))
    assert result.config.streams == 2
    failed = [t for t in result.trials if t.error]
    assert len(failed) == 1 and failed[0].config.streams == 3 and "out of memory" in failed[0].error
    patient = run(Curve(SATURATING, fail=(3,)), schedulers=("critical_path",), patience=2)
    assert patient.config.streams == 4


def test_a_failed_serial_baseline_keeps_one_stream_and_caches_nothing(tmp_path):
    cache = TunerCache(tmp_path)
    result = run(Curve(SATURATING, fail=(1,)), cache=cache, key="k")
    assert result.config == Config(1) and result.baseline is None and "serial graph failed" in result.stopped
    assert cache.entries() == []


def test_budget_stops_before_a_trial_that_would_overrun_it():
    curve = Curve(SATURATING, trial_s=4.0)
    result = run(curve, budget_s=12.0)
    assert len(curve.calls) == 3 and result.seconds <= 12.0
    assert "budget" in result.stopped and result.config.streams == 3


def test_utilization_picks_the_lever_and_a_busy_gpu_gets_an_eager_check():
    launch_bound = Curve(SATURATING)
    r = run(launch_bound, eager_utilization=25.0)
    assert r.lever == "capture" and all(c.cuda_graph for c in launch_bound.calls)
    busy_times = dict(SATURATING)
    busy_times[Config(4, "critical_path", cuda_graph=False)] = 3.9
    busy = Curve(busy_times)
    r = run(busy, eager_utilization=97.0)
    assert r.lever == "streams" and busy.calls[-1] == Config(4, cuda_graph=False)
    assert r.config == Config(4)  # the eager check was slower: the graph stays
    assert run(Curve(SATURATING)).lever == "unknown"


def test_cache_returns_the_stored_choice_without_measuring_and_can_be_cleared(tmp_path):
    cache = TunerCache(tmp_path)
    first = run(Curve(SATURATING), cache=cache, key="abc")
    assert not first.from_cache and len(cache.entries()) == 1

    def must_not_measure(config):
        raise AssertionError("measured despite a cached choice")

    again = tune(must_not_measure, cache=cache, key="abc", progress=False)
    assert again.from_cache and again.config == first.config and again.baseline == first.baseline
    assert again.trials == first.trials
    assert clear_cache(tmp_path) == 1 and cache.entries() == []
    curve = Curve(SATURATING)
    assert not run(curve, cache=cache, key="abc").from_cache and curve.calls


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CONCUR_CACHE_DIR", str(tmp_path / "c"))
    assert tuner.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CONCUR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert tuner.default_cache_dir() == tmp_path / "x" / "concur"


def test_an_unreadable_cache_entry_is_a_miss_with_a_warning(tmp_path):
    cache = TunerCache(tmp_path)
    cache.path.mkdir(parents=True)
    (cache.path / "bad.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert cache.get("bad") is None
    (cache.path / "old.json").write_text(json.dumps({"format": 0, "result": {}}))
    assert cache.get("old") is None


def test_result_round_trips_through_json():
    result = run(Curve(SATURATING, fail=(5,)), eager_utilization=30.0, eager=Measurement(20.0, 1.0, 10))
    again = TuneResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result


def test_progress_bar_prints_one_line_per_trial_in_a_log():
    out = io.StringIO()
    curve = Curve(SATURATING)
    tune(curve, clock=curve.clock, progress=tuner.Progress(20.0, stream=out))
    lines = out.getvalue().splitlines()
    assert len(lines) == len(curve.calls) and all(line.startswith("concur tune [") for line in lines)
    assert "4 streams, critical_path, graph: 3.80 ms" in lines[3]
    assert run(Curve(SATURATING), progress=tuner.Progress(20.0, enabled=False, stream=out)) and \
        len(out.getvalue().splitlines()) == len(lines)


def test_beats_uses_the_standard_error_of_both_medians():
    a, b = Measurement(9.0, 1.0, 16), Measurement(10.0, 1.0, 16)  # stderr 0.232 each -> margin 0.657
    assert beats(a, b, min_gain=0.0)
    assert not beats(Measurement(9.5, 1.0, 16), b, min_gain=0.0)
    assert not beats(b, a)


# --- cache key and the torch-facing helper ---------------------------------------------------------------

def test_cache_key_follows_structure_shapes_dtype_device_and_torch_not_values():
    torch.manual_seed(0)
    model, batch = WideNet(branches=3), (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    key = cache_key(model, batch, "NVIDIA H100", "2.11")
    retrained = copy.deepcopy(model)
    with torch.no_grad():
        for p in retrained.parameters():
            p.add_(1.0)
    assert cache_key(retrained, batch, "NVIDIA H100", "2.11") == key
    other_batch = (torch.randn(4, 3, 8, 8), batch[1])
    strided = copy.deepcopy(model)
    strided.stem[0].stride = (2, 2)
    different = [
        cache_key(model, other_batch, "NVIDIA H100", "2.11"),
        cache_key(model, (batch[0].double(), batch[1]), "NVIDIA H100", "2.11"),
        cache_key(model, batch, "NVIDIA H200", "2.11"),
        cache_key(model, batch, "NVIDIA H100", "2.12"),
        cache_key(strided, batch, "NVIDIA H100", "2.11"),
        cache_key(WideNet(branches=4), batch, "NVIDIA H100", "2.11"),
        cache_key(model, batch, "NVIDIA H100", "2.11", extra=("Adam",)),
    ]
    assert key not in different and len(set(different)) == len(different)


def test_tune_train_step_without_cuda_or_timer_keeps_one_stream_unmeasured():
    model = WideNet(branches=3)
    result = tuner.tune_train_step(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                                   (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))), make_step=concur.train_step,
                                   progress=False)
    assert result.config == Config(1) and result.measurement is None and "no CUDA" in result.stopped


@pytest.fixture
def one_thread():
    """Tiny convolutions on a shared 2-core CI box run ~7x faster without intra-op threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tune_train_step_trains_copies_and_leaves_model_optimizer_and_rng_alone(tmp_path, one_thread):
    torch.manual_seed(0)
    model = WideNet(branches=3)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()  # momentum buffers exist now: they must survive tuning unchanged
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    rng = torch.get_rng_state()
    times = iter([10.0, 9.0, 9.0, 9.5])  # 1 stream, 2 streams (beats), 3 (no gain), fork at 2
    calls = []

    def timer(fn, warmup, repeats):
        fn()  # trains the trial's copy
        calls.append(repeats)
        return next(times), 0.01

    kw = dict(schedulers=("critical_path", "fork"), max_streams=4, cache_dir=tmp_path, progress=False,
              timer=timer, make_step=concur.train_step)
    result = tuner.tune_train_step(model, loss_fn, opt, (x, y), **kw)
    assert [t.config for t in result.trials] == [Config(1), Config(2), Config(3), Config(2, "fork")]
    assert result.config == Config(2) and len(calls) == 4 and all(10 <= r <= 50 for r in calls)
    assert any("no CUDA" in n for n in result.measurement.notes)  # train_step's warning is kept, not shown
    assert result.measurement.notes[0].startswith("runs eager")  # how the trial's step ran (TrainStep.status)
    after = (model.state_dict(), opt.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    for p, s in before[1]["state"].items():
        assert torch.equal(s["momentum_buffer"], after[1]["state"][p]["momentum_buffer"])
    assert torch.equal(rng, torch.get_rng_state())
    cached = tuner.tune_train_step(model, loss_fn, opt, (x, y), **kw)
    assert cached.from_cache and cached.config == Config(2) and len(calls) == 4


class _BusyMonitor:
    """Monitor stand-in whose record reads what NVML reads on a shared GPU: the whole device busy."""

    def __init__(self, index):
        self.record = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def mark(self, label):
        pass

    def mean_utilization(self, start_s=0.0):
        return 98.5


@pytest.mark.parametrize("others", [0, 2, None])
def test_eager_probe_drops_utilization_read_beside_other_processes(monkeypatch, others):
    """NVML's utilization is the device's: beside other processes it says nothing of this loop (a GPU shared by
    tests read 98.5% for GoogLeNet b8's launch-bound eager loop), so the lever must be unknown, not 'streams'."""
    import concur.dag.nvml as nvml
    import concur.observe.monitor as monitor

    monkeypatch.setattr(monitor, "Monitor", _BusyMonitor)
    monkeypatch.setattr(nvml, "other_processes_on", lambda index: others)
    build = lambda config: ((lambda x, y: None), ["kept"])  # noqa: E731
    util, eager, notes = tuner._probe_eager(build, lambda fn, w, r: (5.0, 0.1), lambda: None, None, None, 0.0,
                                            "critical_path", 0)
    assert eager.median_ms == 5.0 and eager.notes == ("kept",)
    if others:
        assert util is None and tuner.lever_for(util) == "unknown" and "2 other processes" in notes[0]
    else:  # alone, or NVML cannot say whose the work is: the reading stands, as before
        assert util == 98.5 and notes == ()

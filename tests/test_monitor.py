"""The NVML monitor against a fake driver: sample timing, dedup, fallbacks, warnings, TensorBoard guard."""

from __future__ import annotations

import sys
import time
import warnings

import pytest

from concur.observe import monitor
from concur.observe.monitor import Monitor, MonitorRecord
from tests.fixtures.fake_nvml import FakeClock, FakeNVML


@pytest.fixture(autouse=True)
def fresh_warnings():
    monitor._warned.clear()
    yield
    monitor._warned.clear()


def drive(mon: Monitor, clock: FakeClock, seconds: float, step: float = 0.05) -> None:
    """Advance the fake clock and poll, as the thread would every ``step`` seconds."""
    for _ in range(round(seconds / step)):
        clock.advance(step)
        mon.poll()


def quiet_monitor(nvml: FakeNVML, clock: FakeClock, **kw) -> Monitor:
    # A huge interval keeps the background thread asleep: the test polls by hand.
    return Monitor(interval_s=3600, nvml=nvml, clock=clock, **kw)


def test_utilization_comes_from_the_driver_buffer_once_per_sample_not_per_poll():
    clock = FakeClock()
    nvml = FakeNVML(clock, utilization=lambda t: 30.0 if (t % 1.0) < 0.5 else 90.0)
    with quiet_monitor(nvml, clock) as mon:
        drive(mon, clock, 1.0)
        clock.advance(0.01)  # past the driver's 1.0 s sample despite float rounding
    rec = mon.record
    assert rec.available and rec.device == "Fake H100" and rec.utilization_source == "samples"
    # 20 polls at 20 Hz (+ the first at start and the last at stop), but only 5 driver samples in 1 s.
    assert len(rec.samples) == 22
    stamps = [u.t_s for u in rec.utilization]
    assert len(stamps) == 5 and stamps == sorted(set(stamps))
    assert all(0 < t <= 1.01 for t in stamps)  # nothing from the buffer before start
    assert {u.gpu_percent for u in rec.utilization} == {30.0, 90.0}
    assert rec.samples[0].memory_used_mb == 1024 and rec.samples[0].sm_clock_mhz == 1980
    assert rec.samples[0].power_w == 350.0
    assert nvml.calls["init"] == nvml.calls["shutdown"] == 1


def test_marks_split_the_record_into_phases_with_their_own_mean_utilization():
    clock = FakeClock()
    level = {"v": 25.0}
    nvml = FakeNVML(clock, utilization=lambda t: level["v"])
    with quiet_monitor(nvml, clock) as mon:
        mon.mark("eager")
        drive(mon, clock, 1.0)
        level["v"] = 100.0
        mon.mark("serial graph")
        clock.advance(0.01)  # the driver's next sample lands inside the new phase
        drive(mon, clock, 1.0)
    phases = mon.record.phases()
    assert [p[0] for p in phases] == ["eager", "serial graph"]
    (_, s0, e0), (_, s1, e1) = phases
    assert e0 == s1 and e1 == pytest.approx(mon.record.duration_s)
    assert mon.record.mean_utilization(s0, e0) == 25.0
    assert mon.record.mean_utilization(s1, e1) == 100.0


def test_record_round_trips_through_json(tmp_path):
    clock = FakeClock()
    with quiet_monitor(FakeNVML(clock), clock) as mon:
        mon.mark("x")
        drive(mon, clock, 0.5)
    path = mon.record.save(tmp_path / "m.json")
    assert MonitorRecord.load(path) == mon.record


def test_without_get_samples_it_polls_rates_and_warns_once():
    clock = FakeClock()
    nvml = FakeNVML(clock, samples_supported=False, utilization=lambda t: 40.0)
    with pytest.warns(RuntimeWarning, match="nvmlDeviceGetSamples failed") as caught:
        with quiet_monitor(nvml, clock) as mon:
            drive(mon, clock, 0.5)
    assert len([w for w in caught if "GetSamples" in str(w.message)]) == 1
    assert mon.record.utilization_source == "rates"
    assert len(mon.record.utilization) == len(mon.record.samples) == 12
    assert {u.gpu_percent for u in mon.record.utilization} == {40.0}


def test_without_a_driver_it_warns_once_records_nothing_and_the_block_runs():
    clock = FakeClock()
    ran = []
    with pytest.warns(RuntimeWarning, match="no GPU metrics") as caught:
        for _ in range(3):
            with quiet_monitor(FakeNVML(clock, fail_init=True), clock) as mon:
                mon.mark("ignored")
                mon.poll()
                ran.append(1)
    assert len(caught) == 1 and ran == [1, 1, 1]
    assert not mon.available and "NVML cannot start" in mon.record.reason
    assert mon.record.samples == [] and mon.record.marks == []


def test_without_nvidia_ml_py_it_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.warns(RuntimeWarning, match="nvidia-ml-py is not installed"):
        with Monitor() as mon:
            pass
    assert not mon.available


def test_background_thread_samples_at_least_10_hz_with_small_overhead():
    nvml = FakeNVML(time.time)
    with Monitor(interval_s=0.02, nvml=nvml) as mon:
        time.sleep(0.5)
    rec = mon.record
    assert rec.duration_s >= 0.5
    assert len(rec.samples) >= 10 * rec.duration_s  # nominal 50 Hz; 10 Hz leaves room for a busy CI
    gaps = [b.t_s - a.t_s for a, b in zip(rec.samples, rec.samples[1:])]
    assert min(gaps) > 0
    assert 0 < rec.sampler_cpu_s and rec.overhead_fraction < 0.25
    assert len(rec.utilization) >= 1  # 200 ms driver samples during 0.5 s
    assert mon._thread is None  # stopped and joined


def test_tensorboard_writer_gets_every_metric():
    clock = FakeClock()

    class Writer:
        def __init__(self):
            self.tags = []

        def add_scalar(self, tag, value, step, walltime=None):
            self.tags.append(tag)

        def close(self):  # pragma: no cover - must not be called on a writer the caller owns
            raise AssertionError("the monitor closed a writer it does not own")

    writer = Writer()
    with quiet_monitor(FakeNVML(clock), clock, tensorboard=writer) as mon:
        drive(mon, clock, 0.4)
    assert set(writer.tags) == {"concur/memory_used_mb", "concur/sm_clock_mhz", "concur/power_w",
                                "concur/gpu_util_percent"}
    assert writer.tags.count("concur/memory_used_mb") == len(mon.record.samples)
    assert writer.tags.count("concur/gpu_util_percent") == len(mon.record.utilization)


def test_tensorboard_log_dir_without_tensorboard_warns_once_and_still_samples(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    clock = FakeClock()
    with pytest.warns(RuntimeWarning, match="tensorboard is not installed") as caught:
        for _ in range(2):
            with quiet_monitor(FakeNVML(clock), clock, tensorboard=tmp_path / "tb") as mon:
                drive(mon, clock, 0.2)
    assert len(caught) == 1
    assert mon.available and len(mon.record.samples) == 6


def test_an_unsupported_metric_is_left_empty_and_the_rest_is_sampled():
    clock = FakeClock()
    nvml = FakeNVML(clock)

    def no_power(handle):
        raise nvml.NVMLError(3)

    nvml.nvmlDeviceGetPowerUsage = no_power
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_monitor(nvml, clock) as mon:
            drive(mon, clock, 0.5)
    assert len([w for w in caught if "power cannot be read" in str(w.message)]) == 1
    assert all(s.power_w is None and s.memory_used_mb == 1024 for s in mon.record.samples)


class _FakeNvml:
    def __init__(self, processes=(), fail=None):
        self.processes, self.fail, self.asked, self.open = list(processes), fail, [], 0

    def nvmlInit(self):
        if self.fail == "init":
            raise RuntimeError("no driver")
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByIndex(self, index):
        self.asked.append(index)
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if self.fail == "processes":
            raise RuntimeError("not supported")
        return self.processes


def test_other_processes_on_a_gpu_are_counted_from_nvml_or_unknown(monkeypatch):
    import os
    from types import SimpleNamespace

    from concur.dag import nvml as nvml_module
    from concur.dag.nvml import other_processes_on

    me = os.getpid()
    # a made-up process tree: 9001 is this process's child (a compile worker), 9002 its grandchild, 7000 another
    # user's job, 7001 that job's child
    parents = {9001: me, 9002: 9001, 7000: 1, 7001: 7000}
    monkeypatch.setattr(nvml_module, "_parent_of", lambda pid: parents.get(pid))
    listed = lambda *pids: [SimpleNamespace(pid=p) for p in pids]  # noqa: E731
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = _FakeNvml(processes=listed(me, 9001, 9002, 7000, 7001))
    assert other_processes_on(0, nvml) == 2 and nvml.open == 0  # its own children are not others; NVML shut again
    assert other_processes_on(0, _FakeNvml(processes=listed(me, 9001))) == 0
    # this process not listed: NVML's pids are another namespace's (a container), or it sees none: unknown
    assert other_processes_on(0, _FakeNvml(processes=listed(7000, 7001))) is None
    assert other_processes_on(0, _FakeNvml(processes=[])) is None
    assert other_processes_on(0, _FakeNvml(fail="init")) is None
    assert other_processes_on(0, _FakeNvml(fail="processes")) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    nvml = _FakeNvml(processes=listed(me))
    other_processes_on(1, nvml)
    assert nvml.asked == [5]  # NVML ignores CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f6c1e2a")
    assert other_processes_on(0, _FakeNvml(processes=listed(me, 7000))) is None


def test_a_process_parent_is_read_from_proc():
    import os

    from concur.dag.nvml import _descends_from, _parent_of

    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        import pytest
        pytest.skip("no /proc here")
    assert _parent_of(os.getpid()) == os.getppid()
    assert _descends_from(os.getpid(), os.getppid()) and not _descends_from(os.getppid(), os.getpid())

"""concur.dag.decide: one keep-or-drop decision for every route, the prediction a filter and the timer the judge.

The timer is faked: each test hands :func:`decide` the rounds a GPU would have
measured, and checks what it keeps, what it caches and what it logs.
"""

from __future__ import annotations

import logging

import networkx as nx
import pytest
import torch

from concur.dag import decide
from concur.dag.disk_cache import JsonCache

FAST = decide.Prediction(num_streams=3, serial_us=130.0, ideal_us=80.0, streams_us=100.0)  # predicted 1.30x
SLOW = decide.Prediction(num_streams=3, serial_us=90.0, ideal_us=60.0, streams_us=100.0)   # predicted 0.90x


class FakeTimer:
    """Rounds of (one stream ms, several streams ms), counting its calls."""

    def __init__(self, rounds):
        self.rounds, self.calls = list(rounds), 0

    def __call__(self):
        self.calls += 1
        return self.rounds


class DictCache:
    def __init__(self):
        self.entries: dict[str, dict] = {}

    def get(self, key):
        return self.entries.get(key)

    def put(self, key, result):
        self.entries[key] = dict(result)


def test_prediction_says_faster_but_measurement_says_slower_keeps_one_stream():
    timer = FakeTimer([(1.00, 1.10)] * 5)
    d = decide.decide("g", FAST, timer=timer)
    assert FAST.speedup == pytest.approx(1.3)
    assert timer.calls == 1 and not d.keep and d.num_streams == 1 and d.source == "measurement"
    assert d.measured.one_stream_ms == pytest.approx(1.0) and d.measured.streams_ms == pytest.approx(1.1)


def test_measured_faster_keeps_the_streams():
    d = decide.decide("g", FAST, timer=FakeTimer([(1.00, 0.80)] * 5))
    assert d.keep and d.num_streams == 3 and d.source == "measurement"
    assert d.measured.speedup == pytest.approx(1.25)


def test_a_gain_within_the_margin_keeps_one_stream():
    """Equal times, or a gain smaller than the margin, are noise: one stream is the safe side."""
    assert not decide.decide("g", FAST, timer=FakeTimer([(1.000, 0.995)] * 5)).keep
    assert not decide.decide("g", FAST, timer=FakeTimer([(1.0, 1.0)] * 5)).keep
    assert decide.decide("g", FAST, timer=FakeTimer([(1.0, 0.98)] * 5)).keep


def test_the_median_of_the_rounds_decides_not_the_mean():
    """Three rounds disturbed (another process, a clock change) must not outvote four clean ones."""
    rounds = [(1.0, 0.8)] * 4 + [(1.0, 5.0)] * 3
    d = decide.decide("g", FAST, timer=FakeTimer(rounds))
    assert d.keep and d.measured.streams_ms == pytest.approx(0.8) and d.measured.rounds == 7


def test_a_plan_predicted_slower_is_dropped_without_timing():
    timer = FakeTimer([(1.0, 0.5)] * 5)
    d = decide.decide("g", SLOW, timer=timer)
    assert timer.calls == 0 and not d.keep and d.source == "prediction" and "below 1x" in d.reason


def test_the_threshold_applies_to_the_prediction():
    timer = FakeTimer([(1.0, 0.5)] * 5)
    assert not decide.decide("g", FAST, min_speedup=1.5, timer=timer).keep and timer.calls == 0
    assert decide.decide("g", FAST, min_speedup=1.2, timer=timer).keep and timer.calls == 1


def test_a_one_stream_schedule_is_never_timed():
    timer = FakeTimer([(1.0, 0.5)] * 5)
    one = decide.Prediction(1, 100.0, 100.0, 100.0)
    assert not decide.decide("g", one, timer=timer).keep and timer.calls == 0


def test_without_a_timer_the_prediction_decides():
    d = decide.decide("g", FAST)
    assert d.keep and d.measured is None and d.source == "prediction" and "not timed" in d.reason


def test_a_timer_that_fails_leaves_the_decision_to_the_prediction():
    def broken():
        raise RuntimeError("operation not permitted when stream is capturing")

    cache = DictCache()
    d = decide.decide("g", FAST, timer=broken, cache=cache, key="k")
    assert d.keep and d.source == "prediction" and "timing failed (RuntimeError: operation not permitted" in d.reason
    assert cache.entries == {}  # nothing measured, nothing stored


def test_a_timing_that_ran_out_of_memory_says_so_whatever_error_ended_it():
    """A capture that runs out mid-way fails at its end with another error, raised while handling the
    allocator's: the reason names the allocator's error, what a user can act on."""
    def out_of_memory_mid_capture():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 MiB. GPU 0 has a total")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: capturing stream has unjoined work")

    d = decide.decide("g", FAST, timer=out_of_memory_mid_capture)
    assert d.keep and "timing failed (OutOfMemoryError: CUDA out of memory. Tried to allocate 26.00 MiB" in d.reason


def test_a_cache_hit_skips_timing_and_repeats_the_decision():
    cache, timer = DictCache(), FakeTimer([(1.0, 1.2)] * 5)
    first = decide.decide("g", FAST, timer=timer, cache=cache, key="k1")
    second = decide.decide("g", FAST, timer=timer, cache=cache, key="k1")
    assert timer.calls == 1
    assert (first.keep, first.source) == (False, "measurement") and (second.keep, second.source) == (False, "cache")
    assert second.measured == first.measured


def test_another_key_misses_the_cache():
    cache, timer = DictCache(), FakeTimer([(1.0, 0.8)] * 5)
    decide.decide("g", FAST, timer=timer, cache=cache, key="batch 8")
    decide.decide("g", FAST, timer=timer, cache=cache, key="batch 16")
    assert timer.calls == 2 and set(cache.entries) == {"batch 8", "batch 16"}


def test_a_cached_entry_of_another_format_is_measured_again():
    cache, timer = DictCache(), FakeTimer([(1.0, 0.8)] * 5)
    cache.entries["k"] = {"streams": 2}
    assert decide.decide("g", FAST, timer=timer, cache=cache, key="k").source == "measurement" and timer.calls == 1


def test_decisions_survive_on_disk(tmp_path):
    timer = FakeTimer([(2.0, 1.5)] * 5)
    decide.decide("g", FAST, timer=timer, cache=JsonCache(tmp_path), key="abc")
    again = decide.decide("g", FAST, timer=timer, cache=JsonCache(tmp_path), key="abc")
    assert timer.calls == 1 and again.source == "cache" and again.keep
    assert again.measured == decide.Measured(2.0, 1.5, 5)
    assert [p.name for p in JsonCache(tmp_path).entries()] == ["abc.json"]


def test_a_stored_decision_says_its_scope():
    cache, timer = DictCache(), FakeTimer([(2.0, 1.5)] * 5)
    decide.decide("g", FAST, timer=timer, cache=cache, key="graph")
    decide.decide("the step", FAST, timer=timer, cache=cache, key="step", scope="step")
    assert cache.entries["graph"]["scope"] == "graph" and cache.entries["step"]["scope"] == "step"


def test_the_key_changes_with_any_part():
    base = ("src", ((8, 3, 32, 32), "torch.float32"), "H100")
    assert decide.decision_key(*base) == decide.decision_key(*base)
    assert decide.decision_key(*base) != decide.decision_key("src", ((16, 3, 32, 32), "torch.float32"), "H100")
    assert decide.decision_key(*base) != decide.decision_key("src", ((8, 3, 32, 32), "torch.bfloat16"), "H100")


def test_each_decision_logs_one_info_line_with_its_times(caplog):
    with caplog.at_level(logging.INFO, logger="concur"):
        decide.decide("the forward graph", FAST, timer=FakeTimer([(1.0, 1.1)] * 5))
        decide.decide("the backward graph", FAST, timer=FakeTimer([(1.0, 0.8)] * 5))
        decide.decide("a stamped graph", SLOW)
    lines = [r.getMessage() for r in caplog.records if r.name == "concur"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "concur")
    assert len(lines) == 3, lines
    assert "the forward graph runs on one stream:" in lines[0] and "measured 1.100 ms on 3 streams against 1.000 ms" in lines[0]
    assert "130.0 us on one stream against 100.0 us" in lines[0]
    assert "the backward graph runs on 3 streams:" in lines[1] and "1.25x" in lines[1]
    assert "a stamped graph runs on one stream:" in lines[2] and "0.90x" in lines[2]


def test_schedule_graph_coarsens_only_when_asked():
    """Fused kernels are coarsened into clusters worth a switch; the fx path schedules op by op."""
    dag = nx.DiGraph([("x", "a1"), ("a1", "a2"), ("x", "b1"), ("b1", "b2"), ("a2", "y"), ("b2", "y")])
    nx.set_node_attributes(dag, 10.0, "cost")
    fine = decide.schedule_graph(dag, 2, "critical_path")
    assert fine.num_streams == 2
    coarse = decide.schedule_graph(dag, 2, "critical_path", cluster_cost_us=50.0)  # no branch is worth a switch
    assert coarse.num_streams == 1


def test_predict_matches_the_shared_device_simulation():
    dag = nx.DiGraph([("x", "a"), ("x", "b"), ("a", "y"), ("b", "y")])
    nx.set_node_attributes(dag, {"x": 1.0, "a": 10.0, "b": 10.0, "y": 1.0}, "cost")
    nx.set_node_attributes(dag, 1.0, "share")  # each kernel fills the device: nothing overlaps
    schedule = decide.schedule_graph(dag, 2, "critical_path")
    p = decide.predict(dag, schedule)
    assert p.num_streams == 2 and p.serial_us == 22.0
    assert p.ideal_speedup > 1.0 > p.speedup  # alone the branches overlap; sharing the device they cannot


def _candidates() -> list[decide.Prediction]:
    # 2, 3 and 4 streams of one graph: 2 predicted 1.25x, 3 and 4 1.30x
    return [decide.Prediction(2, 130.0, 90.0, 104.0), decide.Prediction(3, 130.0, 80.0, 100.0),
            decide.Prediction(4, 130.0, 80.0, 100.0)]


def test_choose_times_every_candidate_and_keeps_the_fastest():
    rounds = [(1.0, 0.9, 0.7, 0.8)] * 5  # one stream, then 2, 3, 4 streams
    cache: dict = {}
    store = type("Store", (), {"get": lambda self, k: cache.get(k), "put": lambda self, k, v: cache.update({k: v})})()
    d = decide.choose("g", _candidates(), timer=lambda: rounds, cache=store, key="k")
    assert d.keep and d.candidate == 1 and d.num_streams == 3 and d.source == "measurement", d
    assert d.measured.streams_ms == 0.7 and d.measured.candidates_ms == (0.9, 0.7, 0.8)
    again = decide.choose("g", _candidates(), timer=lambda: pytest.fail("timed again"), cache=store, key="k")
    assert again.keep and again.candidate == 1 and again.source == "cache", again


def test_choose_prefers_fewer_streams_within_the_margin_and_one_stream_when_none_is_faster():
    within = decide.choose("g", _candidates(), timer=lambda: [(1.0, 0.805, 0.80, 0.81)] * 5)
    assert within.keep and within.num_streams == 2, within  # 2 streams within 1% of the fastest
    slower = decide.choose("g", _candidates(), timer=lambda: [(1.0, 1.0, 1.1, 0.995)] * 5)
    assert not slower.keep and slower.num_streams == 1, slower


def test_choose_without_a_timer_takes_the_fewest_streams_predicted_near_the_best():
    d = decide.choose("g", _candidates())
    assert d.keep and d.candidate == 1 and d.source == "prediction", d  # 3 streams: 2 is more than 3% slower
    flat = [decide.Prediction(2, 130.0, 90.0, 101.0), decide.Prediction(4, 130.0, 80.0, 100.0)]
    assert decide.choose("g", flat).num_streams == 2


def test_choose_skips_candidates_below_the_gate_and_rejects_rounds_of_another_width():
    low = [decide.Prediction(2, 100.0, 90.0, 120.0), decide.Prediction(3, 130.0, 80.0, 100.0)]
    seen = []

    def timer():
        seen.append(1)
        return [(1.0, 0.5)] * 3  # one stream and the one candidate worth timing

    d = decide.choose("g", low, timer=timer)
    assert seen and d.keep and d.candidate == 1, d
    bad = decide.choose("g", low, timer=lambda: [(1.0, 0.5, 0.4)] * 3)
    assert bad.source == "prediction" and "timing failed" in bad.reason, bad


def test_a_timing_is_settled_only_when_every_round_gives_the_same_clear_answer():
    from concur.dag.decide import SETTLED_ROUNDS, settled

    assert not settled([(1.0, 0.5)] * (SETTLED_ROUNDS - 1))  # too few rounds
    assert settled([(1.0, 0.5)] * SETTLED_ROUNDS)  # faster by far more than twice the margin
    assert settled([(1.0, 1.2)] * SETTLED_ROUNDS)  # slower: dropped
    assert settled([(1.0, 1.2, 1.1)] * SETTLED_ROUNDS)  # every candidate slower: dropped, whichever is best
    assert settled([(1.0, 0.5, 0.6)] * SETTLED_ROUNDS)  # the pick among faster candidates, clear in every round
    assert settled([(1.0, 0.6, 0.5, 0.502)] * SETTLED_ROUNDS)  # the same two within the margin in every round
    assert not settled([(1.0, 0.5, 0.6), (1.0, 0.6, 0.5), (1.0, 0.5, 0.6)])  # rounds pick differently
    assert not settled([(1.0, 0.5, 0.507)] * SETTLED_ROUNDS)  # one candidate between margin and twice the margin
    # within the margin of each other in every round, whichever is faster: the pick is the fewer streams of the two
    assert settled([(1.0, 0.5, 0.503), (1.0, 0.5, 0.497), (1.0, 0.5, 0.503)])
    assert not settled([(1.0, 0.5, 0.503), (1.0, 0.5, 0.6), (1.0, 0.5, 0.503)])  # a pair, then one alone
    assert not settled([(1.0, 0.99)] * SETTLED_ROUNDS)  # inside the margin's band
    assert not settled([(1.0, 0.5), (1.0, 1.2), (1.0, 0.5)])  # rounds disagree
    assert not settled([(0.0, 0.5)] * SETTLED_ROUNDS)  # a round that timed nothing


def test_the_wrapper_routes_key_names_the_options_that_change_the_program_timed(monkeypatch):
    # one schedule, two programs: buffer_reuse "ordered" keeps the reuses it orders, False allocates afresh, and
    # the split emits other calls; a decision timed on one must not be read back for the other
    import torch

    import concur
    from concur.inductor import stream_backend as backend_module
    from concur.inductor.stream_backend import BackendOptions, ConcurBackend

    monkeypatch.setattr(backend_module, "can_time", lambda device: True)
    monkeypatch.setattr(backend_module, "environment", lambda device: ("H100", "2.11", "13.0"))
    inputs = [torch.zeros(2, 3)]

    def key_parts(**options):
        return ConcurBackend(BackendOptions(**options))._measuring(inputs, is_backward=True)["key_parts"]

    default = key_parts()
    assert default == key_parts()
    assert default != key_parts(buffer_reuse=False)
    assert default != key_parts(split_weight_grads=False)
    monkeypatch.setattr(concur, "__version__", "0.0.0+other")  # a release that emits differently times again
    assert default != key_parts()


def test_a_decision_timed_beside_other_processes_is_stored_to_read_but_timed_again_later():
    cache = DictCache()
    busy = FakeTimer([])
    busy.rounds = decide.TimedRounds([(2.0, 1.5)] * 5, others=2)  # two other processes had work on the GPU
    first = decide.decide("g", FAST, timer=busy, cache=cache, key="k")
    assert first.keep and cache.entries["k"]["other_processes"] == 2  # stored, to be read (concur cache list)
    assert "timed beside 2 other processes on the GPU" in first.reason
    again = decide.decide("g", FAST, timer=busy, cache=cache, key="k")
    assert busy.calls == 2 and again.source == "measurement"  # not reused: timed again
    quiet = FakeTimer(decide.TimedRounds([(2.0, 1.5)] * 5, others=0))
    decide.decide("g", FAST, timer=quiet, cache=cache, key="k")
    assert "other_processes" not in cache.entries["k"]
    assert decide.decide("g", FAST, timer=quiet, cache=cache, key="k").source == "cache" and quiet.calls == 1


@pytest.mark.parametrize("scheduler", ["critical_path", "fork"])
@pytest.mark.parametrize("cluster_cost_us", [None, 0.0])
def test_one_stream_runs_the_programs_own_order_whatever_the_scheduler(scheduler, cluster_cost_us):
    """A list schedule on one stream runs the longest path first and interleaves the branches; the program's
    order keeps a kernel beside the one that made its input (in L2), as eager PyTorch and inductor run it."""
    import schedulers
    from schedulers.schedule import insertion_order

    dag = nx.DiGraph([("a", "b1"), ("b1", "b2"), ("b2", "d"), ("a", "c1"), ("c1", "c2"), ("c2", "d")])
    nx.set_node_attributes(dag, {"a": 1, "b1": 2, "b2": 2, "c1": 9, "c2": 9, "d": 1}, "cost")
    assert schedulers.schedule(dag, 1, "critical_path").order != tuple(insertion_order(dag)), "interleaved"
    one = decide.schedule_graph(dag, 1, scheduler, cluster_cost_us)
    assert one.order == tuple(insertion_order(dag)) == ("a", "b1", "b2", "c1", "c2", "d")
    assert one.num_streams == 1 and one.waits == ()


def test_the_one_stream_plan_of_a_branchy_model_follows_its_trace():
    import concur

    class Towers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.short = torch.nn.Linear(4, 4)
            self.long = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])

        def forward(self, x):
            return self.short(x).relu() + self.long(x)

    module = concur.optimize(Towers(), (torch.randn(2, 4),), streams=1)
    assert module.schedule.scheduler == "serial" and module.schedule.num_streams == 1

"""schedulers.schedule: what every scheduler returns is valid (waits, order, stream budget), and simulate/simulate_shared.

Pure Python like the package it tests: no torch, no GPU. Each scheduler's own choices are tested in
test_serial.py, test_critical_path.py and test_fork.py.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedulers import (
    SCHEDULERS,
    Wait,
    critical_path,
    fork,
    minimal_waits,
    on_caller,
    schedule,
    serial,
    simulate,
    simulate_shared,
    validate,
)
from tests.dags import PROPS, costed, diamond, fork_join, random_dags

ALL = [serial, critical_path, fork]


@pytest.fixture(name="diamond")
def diamond_fixture() -> nx.DiGraph:
    return diamond()


# ---------------------------------------------------------------- hand-written cases


@pytest.mark.parametrize("scheduler", ALL, ids=lambda f: f.__name__)
def test_chain_stays_on_one_stream_without_waits(scheduler):
    dag = nx.path_graph([f"n{i}" for i in range(6)], create_using=nx.DiGraph)
    nx.set_node_attributes(dag, {v: float(i % 3) for i, v in enumerate(dag)}, "cost")
    s = scheduler(dag, num_streams=4)
    assert s.num_streams == 1 and s.waits == ()
    assert s.order == tuple(f"n{i}" for i in range(6))
    assert validate(dag, s) == []


@pytest.mark.parametrize("scheduler", [critical_path, fork], ids=lambda f: f.__name__)
def test_diamond_runs_branches_on_two_streams_with_two_waits(diamond, scheduler):
    s = scheduler(diamond, num_streams=2)
    assert s.stream["b"] != s.stream["c"]
    # The branch off a's stream needs a's event; d needs the branch not on its stream.
    off = "c" if s.stream["c"] != s.stream["a"] else "b"
    other = "b" if off == "c" else "c"
    expected = {Wait("a", off), Wait(off if s.stream["d"] != s.stream[off] else other, "d")}
    assert set(s.waits) == expected and len(s.waits) == 2
    assert validate(diamond, s) == []


@pytest.mark.parametrize("scheduler", [critical_path, fork], ids=lambda f: f.__name__)
def test_fork_join_of_eight_branches_uses_eight_streams(scheduler):
    dag = fork_join(8)
    s = scheduler(dag, num_streams=8)
    assert s.num_streams == 8 and s.streams_used == tuple(range(8))
    assert len({s.stream[f"b{i}"] for i in range(8)}) == 8
    assert validate(dag, s) == []


def test_transitively_implied_wait_is_not_emitted_and_is_flagged():
    # a -> c is implied by a -> b -> c through the waits a->b and b->c.
    dag = costed([("a", "b"), ("b", "c"), ("a", "c")], {"a": 1, "b": 1, "c": 1})
    order, stream = ("a", "b", "c"), {"a": 0, "b": 1, "c": 2}
    waits = minimal_waits(dag, order, stream)
    assert waits == (Wait("a", "b"), Wait("b", "c"))
    s = dataclasses.replace(
        critical_path(dag, 1), order=order, stream=stream, num_streams=3,
        waits=waits + (Wait("a", "c"),),
    )
    assert any("redundant" in p for p in validate(dag, s))


def test_greedy_prefers_the_wait_that_covers_the_others():
    # d needs a (stream 0) and c (stream 2); c already waited on a, so one wait serves both.
    dag = costed([("a", "c"), ("a", "d"), ("c", "d"), ("b", "d")], {v: 1 for v in "abcd"})
    waits = minimal_waits(dag, "abcd", {"a": 0, "b": 1, "c": 2, "d": 1})
    assert waits == (Wait("a", "c"), Wait("c", "d"))


def test_missing_wait_and_bad_order_are_reported(diamond):
    s = critical_path(diamond, 2, sync_cost=0.0)
    no_waits = dataclasses.replace(s, waits=())
    assert any("not ordered" in p for p in validate(diamond, no_waits))
    backwards = dataclasses.replace(s, order=tuple(reversed(s.order)))
    assert any("not topological" in p for p in validate(diamond, backwards))
    dropped = dataclasses.replace(s, order=s.order[:-1])
    assert any("missing" in p for p in validate(diamond, dropped))
    same_stream = dataclasses.replace(s, waits=s.waits + (Wait("a", "b"),))
    assert any("within stream" in p for p in validate(diamond, same_stream))
    too_early = dataclasses.replace(s, waits=s.waits + (Wait("d", "c"),))
    assert any("issued after" in p for p in validate(diamond, too_early))


def test_unknown_scheduler_names_the_valid_ones(diamond):
    with pytest.raises(ValueError, match="critical_path.*fork.*serial"):
        schedule(diamond, 2, scheduler="nope")


def test_cycle_and_bad_stream_count_raise(diamond):
    cyclic = costed([("a", "b"), ("b", "c"), ("c", "a")], {"a": 1, "b": 1, "c": 1})
    for name in SCHEDULERS:
        with pytest.raises(ValueError, match="cycle"):
            schedule(cyclic, 2, scheduler=name)
    with pytest.raises(ValueError, match="num_streams"):
        schedule(diamond, 0)


def test_simulate_charges_sync_cost_per_wait(diamond):
    s = critical_path(diamond, 2, sync_cost=0.0)
    assert simulate(diamond, s.order, s.stream, s.waits, sync_cost=0.0) == 12.0
    assert simulate(diamond, s.order, s.stream, s.waits, sync_cost=1.0) == 14.0


def test_schedule_accessors(diamond):
    s = critical_path(diamond, 2, sync_cost=0.0)
    assert s.nodes_on(0) == ("a", "b", "d") and s.nodes_on(1) == ("c",)
    assert s.waits_into("d") == (Wait("c", "d"),) and s.waits_into("b") == ()
    assert s.producers() == frozenset({"a", "c"})
    with pytest.raises(TypeError):
        s.stream["a"] = 1  # read-only view


@pytest.mark.parametrize("scheduler", ALL, ids=lambda f: f.__name__)
def test_empty_graph(scheduler):
    s = scheduler(nx.DiGraph(), num_streams=3)
    assert s.order == () and s.num_streams == 1 and s.makespan == 0.0
    assert validate(nx.DiGraph(), s) == []


# ---------------------------------------------------------------- properties


@PROPS
@given(dag=random_dags(), k=st.integers(1, 8), name=st.sampled_from(sorted(SCHEDULERS)))
def test_every_schedule_is_valid_and_within_stream_budget(dag, k, name):
    s = schedule(dag, k, scheduler=name)
    assert validate(dag, s) == []
    assert 1 <= s.num_streams <= k
    assert all(0 <= t < k for t in s.stream.values())


@PROPS
@given(dag=random_dags(), k=st.integers(2, 8), name=st.sampled_from(sorted(SCHEDULERS)), data=st.data())
def test_nodes_moved_to_the_callers_stream_run_there_in_the_same_order_and_every_edge_is_kept(dag, k, name, data):
    s = schedule(dag, k, scheduler=name)
    moved = set(data.draw(st.lists(st.sampled_from(sorted(dag.nodes)), unique=True)))
    confined = on_caller(dag, s, moved)
    assert validate(dag, confined) == [] and confined.order == s.order
    assert all(confined.stream[v] == 0 for v in moved)
    # the others stay together as before (the numbers may change: streams are numbered by first use)
    rest = [v for v in s.order if v not in moved]
    assert all((s.stream[u] == s.stream[v]) == (confined.stream[u] == confined.stream[v])
               for u in rest for v in rest if confined.stream[u] and confined.stream[v])


@PROPS
@given(dag=random_dags(), k=st.integers(2, 8), name=st.sampled_from(["critical_path", "fork"]),
       data=st.data())
def test_validate_catches_a_dropped_wait(dag, k, name, data):
    s = schedule(dag, k, scheduler=name, sync_cost=0.0)
    if not s.waits:
        return
    i = data.draw(st.integers(0, len(s.waits) - 1))
    broken = dataclasses.replace(s, waits=s.waits[:i] + s.waits[i + 1:])
    assert validate(dag, broken) != []


# ---------------------------------------------------------------- contention (simulate_shared)


@PROPS
@given(dag=random_dags(), k=st.integers(1, 8), name=st.sampled_from(sorted(SCHEDULERS)),
       sync_cost=st.floats(0, 5))
def test_shared_simulation_without_shares_is_simulate(dag, k, name, sync_cost):
    s = schedule(dag, k, scheduler=name, sync_cost=sync_cost)
    assert simulate_shared(dag, s) == pytest.approx(s.makespan, rel=1e-9, abs=1e-6)


@PROPS
@given(dag=random_dags(), k=st.integers(1, 8), data=st.data())
def test_contention_only_slows_and_kernels_that_fill_the_device_add_up(dag, k, data):
    for v in dag.nodes:
        dag.nodes[v]["share"] = {"compute": data.draw(st.floats(0, 1)), "memory": data.draw(st.floats(0, 1))}
    s = critical_path(dag, k, sync_cost=0.0)
    assert simulate_shared(dag, s) >= s.makespan - 1e-6
    nx.set_node_attributes(dag, 1.0, "share")  # every kernel fills the device: no overlap can help
    assert simulate_shared(dag, s) == pytest.approx(serial(dag).makespan, rel=1e-9, abs=1e-6)


def test_a_compute_bound_and_a_memory_bound_kernel_overlap_two_compute_bound_do_not():
    def two_kernels(share_b):
        dag = nx.DiGraph()
        dag.add_node("a", cost=4.0, share={"compute": 1.0, "memory": 0.1})
        dag.add_node("b", cost=4.0, share=share_b)
        return dag, critical_path(dag, 2, sync_cost=0.0)

    dag, s = two_kernels({"compute": 0.1, "memory": 1.0})
    assert s.num_streams == 2 and simulate_shared(dag, s) == pytest.approx(4.4)  # memory: 1.1 for 4 units
    dag, s = two_kernels({"compute": 1.0, "memory": 0.1})
    assert simulate_shared(dag, s) == pytest.approx(8.0)
    dag, s = two_kernels({"compute": 0.3, "memory": 0.3})
    assert simulate_shared(dag, s) == pytest.approx(5.2)  # compute 1.3: both run at 1/1.3



"""schedulers.critical_path: free nodes stay with their producer; never slower than serial, never below the bound."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schedulers import critical_path, critical_path_length, serial, validate
from tests.dags import PROPS, costed, random_dags


def test_zero_cost_node_stays_with_its_producer():
    # With no sync cost, "view" finishes at 11 on every stream; it must not leave c's stream.
    dag = costed(
        [("a", "b"), ("a", "c"), ("c", "view"), ("view", "e"), ("b", "f")],
        {"a": 1, "b": 10, "c": 10, "view": 0, "e": 1, "f": 1},
    )
    s = critical_path(dag, 3, sync_cost=0.0)
    assert s.stream["c"] != 0
    assert s.stream["view"] == s.stream["e"] == s.stream["c"]


@PROPS
@given(dag=random_dags(), k=st.integers(1, 8))
def test_critical_path_never_slower_than_serial_without_sync_cost(dag, k):
    s = critical_path(dag, k, sync_cost=0.0)
    assert validate(dag, s) == []
    assert s.makespan <= serial(dag).makespan + 1e-6
    assert s.makespan >= critical_path_length(dag) - 1e-6

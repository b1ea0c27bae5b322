"""schedulers.fork: chains keep their stream, each branch opens one, the least loaded takes a new branch."""

from __future__ import annotations

from schedulers import fork, validate
from tests.dags import costed


def test_with_fewer_streams_than_branches_a_new_branch_goes_to_the_least_loaded_stream():
    # a forks into four branches; b1 keeps a's stream. With round-robin b4 would join the heavy b2.
    branches = ("b1", "b2", "b3", "b4")
    dag = costed([("a", b) for b in branches] + [(b, "d") for b in branches],
                 {"a": 1, "b1": 1, "b2": 10, "b3": 1, "b4": 1, "d": 1})
    s = fork(dag, num_streams=3, sync_cost=0.0)
    assert [s.stream[b] for b in branches] == [0, 1, 2, 2]
    assert s.stream["d"] == s.stream["b2"]  # a join goes to its heaviest predecessor's stream
    assert validate(dag, s) == []


def test_a_second_source_opens_a_branch_so_independent_chains_run_side_by_side():
    dag = costed([("x1", "y1"), ("x2", "y2")], {"x1": 1, "y1": 1, "x2": 1, "y2": 1})
    s = fork(dag, num_streams=2)
    assert dict(s.stream) == {"x1": 0, "y1": 0, "x2": 1, "y2": 1} and s.waits == ()

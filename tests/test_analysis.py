"""schedulers.analysis: critical path length, width and predicted speedups, with and without contention."""

from __future__ import annotations

import networkx as nx
import pytest

from schedulers import critical_path_length, predicted_speedups, width
from tests.dags import diamond, fork_join


def test_analysis_numbers():
    assert critical_path_length(diamond()) == 12.0
    assert width(diamond()) == 2 and width(fork_join(8)) == 8 and width(nx.DiGraph()) == 0


def test_speedup_of_two_equal_heavy_branches():
    ideal = (1 + 2 * 10 + 1) / (1 + 10 + 1)
    speedups = predicted_speedups(diamond(), max_streams=4, sync_cost=0.0)
    assert speedups[1] == pytest.approx(1.0)
    assert all(v == pytest.approx(ideal) for k, v in speedups.items() if k >= 2)
    # At the default sync cost of 1 each of the two waits delays the finish by 1.
    assert predicted_speedups(diamond(), max_streams=2)[2] == pytest.approx(22 / 14)


def test_contention_aware_speedups_are_lower_for_kernels_that_fill_the_device():
    dag = fork_join(4)
    nx.set_node_attributes(dag, 0.5, "share")
    ideal = predicted_speedups(dag, 4, sync_cost=0.0)
    shared = predicted_speedups(dag, 4, sync_cost=0.0, contention=True)
    assert shared[1] == ideal[1] == 1.0
    assert 1.0 < shared[4] < ideal[4]

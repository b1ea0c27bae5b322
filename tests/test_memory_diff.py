"""experiments/memory_diff.py on the CPU: its command line, and its refusal without a GPU (it reads the CUDA caching
allocator's history; tests/test_gpu_step_cost.py runs it on one)."""

from __future__ import annotations

import pytest
import torch

from experiments import memory_diff


def test_arguments_name_the_side_and_default_to_resnet50_b8_on_one_stream():
    args = memory_diff.parse_args(["--who", "recipe"])
    assert (args.who, args.model, args.batch, args.streams, args.compile, args.json, args.lean_pools) == \
        ("recipe", "resnet50", 8, 1, False, None, False)
    assert memory_diff.parse_args(["--who", "concur", "--streams", "2", "--lean-pools"]).lean_pools
    with pytest.raises(SystemExit):
        memory_diff.parse_args([])  # which side is measured has no default: one process per side
    with pytest.raises(SystemExit):
        memory_diff.parse_args(["--who", "both"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_before_building_anything():
    with pytest.raises(SystemExit, match="needs a GPU"):
        memory_diff.main(["--who", "concur"])

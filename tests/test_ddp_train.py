"""experiments/ddp_train.py on the CPU: its arguments, its refusal of --cuda-graph without GPUs, and one gloo process
training a small branchy net with --compare (concur's DDP against plain DDP from the same start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import ddp_train

ROOT = Path(__file__).resolve().parents[1]

SMALL_NET = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1), nn.Linear(8, 10)

    def forward(self, x):
        both = torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], 1)
        return self.head(F.adaptive_avg_pool2d(both, 1).flatten(1))


def make():
    return TwoBranches()
'''


def test_arguments_default_to_googlenet_on_four_streams():
    args = ddp_train.parse_args([])
    assert (args.model, args.steps, args.batch_size, args.streams, args.cuda_graph, args.compare) == \
        ("torchvision:googlenet", 20, 8, 4, False, False)
    args = ddp_train.parse_args(["--model", "m:f", "--steps", "3", "--cuda-graph", "--compare"])
    assert (args.model, args.steps, args.cuda_graph, args.compare) == ("m:f", 3, True, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without GPUs")
def test_cuda_graph_without_gpus_is_refused_before_any_process_group():
    with pytest.raises(SystemExit, match="needs GPUs"):
        ddp_train.main(["--cuda-graph"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo path is the CPU's")
def test_one_gloo_process_trains_and_compares_with_plain_ddp(tmp_path):
    (tmp_path / "small_net.py").write_text(SMALL_NET)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29517", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "ddp_train.py"), "--model", "small_net:make",
                           "--steps", "3", "--batch-size", "2", "--image-size", "8", "--streams", "2", "--compare"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "concur (2 streams) + DDP, 1 processes" in out and "plain DDP step time" in out
    concur_line = next(line for line in out.splitlines() if line.startswith("concur "))
    assert float(concur_line.split()[1]) == 0.0  # the first loss: the same start, the same data

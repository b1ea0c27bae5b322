"""The device benchmarks' shell scripts (experiments/bench28.sh, bench29.sh) run with python3 and nvidia-smi faked:
which sweeps each part starts, and which arguments they refuse before starting anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar")


def run_script(tmp_path: Path, script: str, *args: str) -> tuple[int, list[str], str]:
    """Run ``script`` with a python3 that logs its arguments and an nvidia-smi that prints a name; return the exit
    status, the python3 command lines, and stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "python3.log"
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\necho "$*" >> "{log}"\n')
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho fake\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(EXPERIMENTS / script), str(tmp_path / "run"), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, calls, done.stderr


def sweeps(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m experiments.sweep") and "--report-only" not in c]


def test_bench28_runs_several_parts_side_by_side_over_one_run_directory(tmp_path):
    rc, calls, _ = run_script(tmp_path, "bench28.sh", "g", "h", "j")
    assert rc == 0
    started = sweeps(calls)
    # g: Inception-v4 on its own and HRNet + DLA-34 at b64; h: the three CNNs in fp32 at b32; j: HRNet + DLA-34 unfused
    assert len(started) == 4
    assert all(f"--out {tmp_path / 'run'} " in c for c in started)  # one directory: one GPU lock
    assert any("timm:hrnet_w18_small timm:dla34 --batches 8" in c and "concur_graph:4" in c for c in started)
    assert sum("--report-only" in c for c in calls) == 1  # one report over every part's rows
    assert sorted(p.name for p in (tmp_path / "out").glob("bench_*.log")) == ["bench_g.log", "bench_h.log",
                                                                             "bench_j.log", "bench_report.log"]


@pytest.mark.parametrize("args", [("a", "k"), ()], ids=["unknown part", "no part"])
def test_bench28_refuses_a_bad_part_before_starting_any(tmp_path, args):
    rc, calls, err = run_script(tmp_path, "bench28.sh", *args)
    assert rc == 2 and calls == [] and "a to j" in err


@pytest.mark.parametrize("args", [("a", "j", "c"), ("f", "e"), ("i", "f")])
def test_bench28_refuses_parts_that_do_not_fit_side_by_side(tmp_path, args):
    """a and c side by side ran out of GPU memory in 12 of their 36 rows on an H100 (2026-11-27)."""
    rc, calls, err = run_script(tmp_path, "bench28.sh", *args)
    assert rc == 2 and calls == [] and "do not fit" in err


def test_bench29_times_named_networks_alone(tmp_path):
    rc, calls, _ = run_script(tmp_path, "bench29.sh", "alone", "timm:mixnet_s", "timm:dla34")
    assert rc == 0
    started = sweeps(calls)
    assert [c.split("--models ")[1].split()[0] for c in started] == ["timm:mixnet_s", "timm:dla34"]
    assert all(f"--out {tmp_path / 'run' / 'alone'} " in c and "--compile-jobs 1" in c
               and "--together peer_compile_graph+compile_graph+fused:4" in c for c in started)
    rc, calls, _ = run_script(tmp_path, "bench29.sh", "alone-unfused", "timm:dla34")
    assert rc == 0 and "--together peer_eager_graph+serial_graph+concur_graph:4" in sweeps(calls)[-1]


@pytest.mark.parametrize("args", [("alone",), ("z1", "timm:dla34")], ids=["alone, no network", "z1 with one"])
def test_bench29_refuses_networks_where_a_part_takes_none_and_none_where_it_needs_them(tmp_path, args):
    rc, calls, err = run_script(tmp_path, "bench29.sh", *args)
    assert rc == 2 and sweeps(calls) == [] and err

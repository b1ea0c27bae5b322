"""The device machine's shell scripts (experiments/recipes.sh, zoo.sh, gpu_check.sh) run with python3 and nvidia-smi
faked: which sweeps and tools each part or step starts, and which arguments they refuse before starting anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar")


def run_script(tmp_path: Path, script: str, *args: str, run_dir: bool = True, out: bool = True,
               extra_env: dict[str, str] | None = None) -> tuple[int, list[str], str]:
    """Run ``script`` (given ``tmp_path/run`` first where ``run_dir``, and ``$OUT`` where ``out``) with a python3 that
    logs its arguments and an nvidia-smi that prints a name; return the exit status, the python3 command lines, and
    stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "python3.log"
    # where CONCUR_ENV_LOG is set, each call also logs its CONCUR_MEASURE and CONCUR_PROBE_CALLER_OUTPUTS ("-": unset)
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\necho "$*" >> "{log}"\n'
                                     '[ -n "$CONCUR_ENV_LOG" ] && echo "${CONCUR_MEASURE:--} '
                                     '${CONCUR_PROBE_CALLER_OUTPUTS:--}" >> "$CONCUR_ENV_LOG"\n'
                                     'exit 0\n')
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho fake\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("OUT", None)
    env.update(extra_env or {})
    if out:
        env["OUT"] = str(tmp_path / "out")
    first = [str(tmp_path / "run")] if run_dir else []
    done = subprocess.run(["bash", str(EXPERIMENTS / script), *first, *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, calls, done.stderr


def sweeps(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m experiments.sweep") and "--report-only" not in c]


def test_recipes_runs_several_parts_side_by_side_over_one_run_directory(tmp_path):
    rc, calls, _ = run_script(tmp_path, "recipes.sh", "g", "h", "j")
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
def test_recipes_refuses_a_bad_part_before_starting_any(tmp_path, args):
    rc, calls, err = run_script(tmp_path, "recipes.sh", *args)
    assert rc == 2 and calls == [] and "a to j" in err


@pytest.mark.parametrize("args", [("a", "j", "c"), ("f", "e"), ("i", "f")])
def test_recipes_refuses_parts_that_do_not_fit_side_by_side(tmp_path, args):
    """a and c side by side run out of one H100's memory (twelve compile workers, each child holding its models)."""
    rc, calls, err = run_script(tmp_path, "recipes.sh", *args)
    assert rc == 2 and calls == [] and "do not fit" in err


def test_zoo_times_named_networks_alone(tmp_path):
    rc, calls, _ = run_script(tmp_path, "zoo.sh", "alone", "timm:mixnet_s", "timm:dla34")
    assert rc == 0
    started = sweeps(calls)
    assert [c.split("--models ")[1].split()[0] for c in started] == ["timm:mixnet_s", "timm:dla34"]
    assert all(f"--out {tmp_path / 'run' / 'alone'} " in c and "--compile-jobs 1" in c
               and "--together peer_compile_graph+compile_graph+fused:4" in c for c in started)
    rc, calls, _ = run_script(tmp_path, "zoo.sh", "alone-unfused", "timm:dla34")
    assert rc == 0 and "--together peer_eager_graph+serial_graph+concur_graph:4" in sweeps(calls)[-1]


@pytest.mark.parametrize("args", [("alone",), ("z1", "timm:dla34")], ids=["alone, no network", "z1 with one"])
def test_zoo_refuses_networks_where_a_part_takes_none_and_none_where_it_needs_them(tmp_path, args):
    rc, calls, err = run_script(tmp_path, "zoo.sh", *args)
    assert rc == 2 and sweeps(calls) == [] and err


def test_recipes_logs_beside_its_run_directory_without_out(tmp_path):
    rc, _, _ = run_script(tmp_path, "recipes.sh", "a", out=False)
    assert rc == 0 and (tmp_path / "run-out" / "bench_a.log").exists()


def test_gpu_check_needs_an_output_folder_and_starts_nothing_without_one(tmp_path):
    rc, calls, err = run_script(tmp_path, "gpu_check.sh", "memory", run_dir=False, out=False)
    assert rc == 2 and calls == [] and "OUT" in err and "--out" in err


@pytest.mark.parametrize("args", [("memory", "no-such-step"), ()], ids=["unknown step", "no step"])
def test_gpu_check_refuses_a_bad_step_before_starting_any(tmp_path, args):
    rc, calls, err = run_script(tmp_path, "gpu_check.sh", *args, run_dir=False)
    assert rc == 2 and calls == [] and err


def test_gpu_check_memory_step_writes_under_its_own_folder(tmp_path):
    rc, calls, _ = run_script(tmp_path, "gpu_check.sh", "--out", str(tmp_path / "given"), "memory", run_dir=False,
                              out=False)
    assert rc == 0
    assert f"-m experiments.memory --out {tmp_path / 'given' / 'memory'}" in calls
    assert (tmp_path / "given" / "gpu.txt").exists()


def test_gpu_check_speed_and_zoo_steps_run_their_scripts_under_out(tmp_path):
    rc, calls, _ = run_script(tmp_path, "gpu_check.sh", "speed", "zoo", "setup", run_dir=False)
    assert rc == 0
    started = sweeps(calls)
    assert any(f"--out {tmp_path / 'out' / 'speed' / 'run'} " in c and "peer_compile_graph" in c for c in started)
    assert any(f"--out {tmp_path / 'out' / 'zoo' / 'run'} " in c and "googlenet inception_v3 resnet50" in c
               for c in started)
    setups = [c for c in calls if c.startswith("-m experiments.setup_cost")]
    assert len(setups) == 3 and all(f"--json {tmp_path / 'out' / 'setup' / 'setup.jsonl'}" in c for c in setups)


def test_gpu_check_stress_step_counts_captures_under_its_own_folder(tmp_path):
    rc, calls, _ = run_script(tmp_path, "gpu_check.sh", "stress", run_dir=False)
    assert rc == 0
    assert any(c.startswith(f"-m experiments.capture_stress --out {tmp_path / 'out' / 'stress'} --deadline ")
               for c in calls), calls


def test_gpu_check_memdiff_step_runs_four_sides_of_each_spec_each_into_its_own_file(tmp_path):
    env_log = tmp_path / "env.log"
    rc, calls, _ = run_script(tmp_path, "gpu_check.sh", "memdiff", run_dir=False,
                              extra_env={"MEMDIFF_SPECS": "googlenet 8 --compile;resnet50 8",
                                         "CONCUR_ENV_LOG": str(env_log)})
    assert rc == 0
    diffs = [c for c in calls if c.startswith("-m experiments.memory_diff")]
    assert len(diffs) == 8
    assert sum("--who recipe" in c for c in diffs) == 2 and sum("--no-step-decision" in c for c in diffs) == 2
    assert sum("--compile" in c for c in diffs) == 4
    assert all(("--streams 4" in c) == ("--who concur" in c) for c in diffs)  # concur's default, not memory_diff's 1
    files = [c.split("--json ")[1] for c in diffs]
    assert len(set(files)) == 8  # side by side, so no two processes append to one file
    # the timing-off side alone runs with CONCUR_MEASURE=0
    assert env_log.read_text().split().count("0") == 2


def test_gpu_check_probe_step_runs_the_sanitizer_then_the_memory_benchmark_under_each_form(tmp_path):
    env_log = tmp_path / "env.log"
    rc, calls, _ = run_script(tmp_path, "gpu_check.sh", "probe", run_dir=False,
                              extra_env={"PROBE_LIMITS": "1.05 20", "CONCUR_ENV_LOG": str(env_log)})
    assert rc == 0
    sanitized = [c for c in calls if c.startswith("-m tests.gpu_sanitized_run")]
    assert len(sanitized) == 4 and {c.split("--caller-outputs ")[1] for c in sanitized} == {"backward-on-caller",
                                                                                           "outputs"}
    runs = [c for c in calls if c.startswith("-m experiments.memory")]
    out = tmp_path / "out" / "probe"
    assert [c.split("--out ")[1].split()[0] for c in runs] == [
        str(out / f"{form}_{limit}") for form in ("backward-on-caller", "outputs") for limit in ("1.05", "20")]
    assert all("--streams 2" in c and "--paths unfused" in c for c in runs)
    forms = [line.split()[1] for line in env_log.read_text().splitlines()]
    assert forms[-4:] == ["backward-on-caller", "backward-on-caller", "outputs", "outputs"]  # memory.py's probe switch
    assert forms[-8:-4] == ["-"] * 4  # the sanitized runs take it as an argument

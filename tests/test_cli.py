"""The concur command: help and defaults, one-line user errors, model specs, the device model, the demo's check."""

from __future__ import annotations

import argparse
import os
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from concur import cli
from concur.cli import build_parser, main
from concur.zoo import ModelSpecError

TINY = ["tests.models:WideNet", "--batch-size", "2", "--image-size", "16"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", ["inspect", "demo", "report", "cache"])
def test_every_option_has_help_text_that_gives_its_default(command):
    sub = _subparsers(build_parser())[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert text, f"concur {command} {action.dest}: no help text"
        assert "default" in text or "required" in text, f"concur {command} {action.dest}: {text!r}"
        if action.default not in (None, False):
            assert str(action.default) in text, f"concur {command} {action.dest}: {text!r}"


def _fake_timm(monkeypatch, **cfg):
    """Install a stand-in for timm with one model, ``tiny``, whose pretrained_cfg is ``cfg``."""
    def create_model(name, pretrained=False):
        assert name == "tiny" and pretrained is False
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
        model.pretrained_cfg = cfg
        return model

    timm = types.SimpleNamespace(create_model=create_model, is_model=lambda name: name == "tiny",
                                 list_models=lambda: ["tiny", "tinier"])
    monkeypatch.setitem(sys.modules, "timm", timm)
    # where timm lists what fx must not trace (concur's capture reads it whenever timm is imported)
    monkeypatch.setitem(sys.modules, "timm.layers._fx", types.SimpleNamespace(
        get_notrace_modules=lambda: [], get_notrace_functions=lambda: []))


@pytest.mark.parametrize("argv, fix", [
    (["inspect", "googlenet"], "did you mean torchvision:googlenet?"),
    (["inspect", "torchvision:googlenett"], "did you mean torchvision:googlenet"),
    (["inspect", "torchvision:inception_v3", "--image-size", "64"], "use 75 or more, or leave it out for its own 299"),
    (["inspect", "torchvision:vit_b_16", "--image-size", "64"], "use --image-size 224"),
    (["inspect", "timm:create_model"], "timm has no model 'create_model': timm.list_models() lists them"),
    (["inspect", "torch.nn:Linear"], "must be callable without arguments"),
    (["inspect", "no_such_module:make"], "cannot import 'no_such_module'"),
    (["inspect", "tests.models:Untraceable", "--image-size", "8", "--batch-size", "2"], "concur.optimize"),
])
def test_a_user_error_is_one_line_with_the_fix_and_exit_code_2(argv, fix, capsys, monkeypatch):
    _fake_timm(monkeypatch)
    code = main(argv)
    captured = capsys.readouterr()
    if argv[1] == "tests.models:Untraceable":  # not the user's typo: a model concur cannot trace, exit 1
        assert code == 1 and "CaptureError" in captured.err and fix in captured.err
        return
    assert code == 2, captured
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith(f"concur {argv[0]}: error: ") and fix in captured.err


def test_debug_shows_the_traceback_instead():
    with pytest.raises(ModelSpecError, match="did you mean torchvision:googlenet"):
        main(["inspect", "googlenet", "--debug"])


def test_an_input_the_model_cannot_take_names_the_failure_and_the_models_own_size(capsys, monkeypatch):
    _fake_timm(monkeypatch, input_size=(3, 40, 40), min_input_size=(3, 8, 8))
    assert main(["inspect", "timm:tiny", "--image-size", "4"]) == 2
    assert "below the smallest input timm:tiny accepts (8 px): use 8 or more" in capsys.readouterr().err
    _fake_timm(monkeypatch, input_size=(3, 40, 40))  # no minimum known: the model's own failure says it
    assert main(["inspect", "timm:tiny", "--image-size", "2"]) == 2  # a 3x3 conv on 2x2
    err = capsys.readouterr().err
    assert "timm:tiny failed on a 8x3x2x2 input: RuntimeError: Calculated padded input size" in err
    assert err.endswith("try its own size, --image-size 40\n") and err.count("\n") == 1


def test_timm_models_get_timms_input_size(capsys, monkeypatch):
    _fake_timm(monkeypatch, input_size=(3, 40, 40))
    assert main(["inspect", "timm:tiny", "--batch-size", "2"]) == 0
    assert capsys.readouterr().out.startswith("timm:tiny, batch 2, 40x40, train mode")
    _fake_timm(monkeypatch, input_size=(3, 48, 48), fixed_input_size=True)
    assert main(["inspect", "timm:tiny", "--image-size", "40"]) == 2
    assert "takes 48 px inputs only" in capsys.readouterr().err


def _speedups(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^\s+(\d)\s+([\d.]+)x", out, re.M)}


def test_inspect_prints_plan_and_the_device_model_it_predicts_for(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["inspect", *TINY]) == 0
    auto = capsys.readouterr().out
    assert "--device auto: no GPU here, so an H100" in auto
    assert "device model       h100 roofline (150 TFLOP/s, 2.8 TB/s, 2.0 us per kernel)" in auto
    assert re.search(r"on 4 streams \(ops per stream \[\d+, \d+, \d+, \d+\]\), \d+ cross-stream waits, "
                     r"predicted makespan [\d,.]+ us on the h100 roofline", auto)
    assert main(["inspect", *TINY, "--device", "cpu"]) == 0
    cpu = capsys.readouterr().out
    assert "device model       cpu roofline" in cpu and "on the cpu roofline" in cpu and "H100" not in cpu
    # the same 10-branch net: a device with more launch overhead per unit of work predicts less overlap
    assert _speedups(auto)[1] == _speedups(cpu)[1] == 1.0
    assert _speedups(auto)[4] > _speedups(cpu)[4] > 1.0


def test_auto_on_a_gpu_machine_models_that_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    cost, note = cli.device_model("auto")
    assert cost.roofline.name == "a100" and note == "--device auto: this machine's NVIDIA A100-SXM4-80GB"
    assert cli.device_model("h200") == (cli.AnalyticCost(cli.ROOFLINES["h200"]), "")


def _demo_errors(out: str) -> tuple[float, float, float]:
    m = re.search(r"output rel. error (\S+), gradient rel. error (\S+) \(same plan on one stream: (\S+)\)", out)
    return tuple(map(float, m.groups()))


def test_demo_checks_against_the_original_and_catches_a_wrong_plan(capsys, monkeypatch):
    args = ["demo", "--batch-size", "2", "--image-size", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("concur demo: torchvision:googlenet, batch 2, 32x32, on cpu")
    out_err, grad_err, reorder_err = _demo_errors(out)
    assert out_err < 1e-5 and grad_err <= max(1e-5, 4 * reorder_err) and out.rstrip().endswith("timings need CUDA.")

    real_optimize = cli.api.optimize

    def off_by_a_little(model, example, streams, **kw):  # a planted bug in the concurrent plan
        cm = real_optimize(model, example, streams=streams, **kw)
        if streams > 1:
            cm.register_forward_hook(lambda mod, inputs, output: output * 1.001)
        return cm

    monkeypatch.setattr(cli.api, "optimize", off_by_a_little)
    assert main(["demo", *TINY]) == 1
    out = capsys.readouterr().out
    assert "-> MISMATCH" in out and _demo_errors(out)[0] == pytest.approx(1e-3, rel=0.01)


def test_cache_lists_and_clears(tmp_path, capsys):
    """Both caches a later run reads instead of measuring: the tuner's choices and the measured decisions."""
    from concur.dag.disk_cache import JsonCache
    from concur.observe.tune_cache import TunerCache

    TunerCache(tmp_path).put("k1", {"streams": 2})
    JsonCache(tmp_path).put("d1", {"streams": 1})
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"1 cached tuner choice(s) in {tmp_path / 'tuner'}", "  k1.json",
        f"1 measured stream decision(s) in {tmp_path / 'decisions'}", "  d1.json"]
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"removed 1 cached tuner choice(s) from {tmp_path / 'tuner'}",
        f"removed 1 measured stream decision(s) from {tmp_path / 'decisions'}"]
    assert TunerCache(tmp_path).get("k1") is None and JsonCache(tmp_path).get("d1") is None


def test_cache_list_says_what_each_measured_decision_rests_on(tmp_path, capsys):
    """A decision timed on a busy GPU is read back by every later run: the list shows its times to find it."""
    from concur.dag.disk_cache import JsonCache

    JsonCache(tmp_path).put("d2", {"keep": False, "one_stream_ms": 7.185, "streams_ms": 11.04, "rounds": 3,
                                   "predicted_speedup": 1.116, "num_streams": 4,
                                   "what": "the forward and backward of ResNet (2 graphs on streams)"})
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  d2.json: the forward and backward of ResNet (2 graphs on streams): dropped 4 streams, measured 0.65x "
        "(7.185 ms on one stream, 11.040 ms on streams, 3 rounds), predicted 1.12x")
    JsonCache(tmp_path).put("d2", {"keep": True, "one_stream_ms": 2.0, "streams_ms": 1.0, "rounds": 7,
                                   "predicted_speedup": 1.5, "num_streams": 2, "other_processes": 3})
    main(["cache", "list", "--dir", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  d2.json: a graph: kept 2 streams, measured 2.00x (2.000 ms on one stream, 1.000 ms on streams, 7 rounds), "
        "predicted 1.50x; timed beside 3 other process(es) on the GPU, not reused")


def test_python_dash_m_concur_is_the_command_and_passes_on_its_exit_code(tmp_path):
    import subprocess

    # from an empty folder: a clone's parent folder holds a concur/ without __init__.py, which -m would import
    done = subprocess.run([sys.executable, "-m", "concur", "no-such-command"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 2 and "usage: concur" in done.stderr


THREE_BRANCHES = '''
import torch
import torch.nn as nn


class ThreeBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Conv2d(3, 8, 3, padding=1) for _ in range(3))

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], dim=1)


def make():
    return ThreeBranches()
'''


@pytest.fixture
def model_file_in_a_temp_cwd(tmp_path, monkeypatch):
    """A model file in a fresh current folder, which is not on sys.path (as for the installed ``concur`` script)."""
    name = f"my_net_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(THREE_BRANCHES)
    monkeypatch.chdir(tmp_path)
    # `python -m pytest` puts the folder it started in on sys.path ('' or its path): not the temp cwd's
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("form", ["{name}:make", "{name}.py:make", "./{name}.py:make"])
def test_a_spec_of_a_file_in_the_current_folder_is_imported_as_python_dash_m_would(
        form, model_file_in_a_temp_cwd, capsys):
    path_before = list(sys.path)
    spec = form.format(name=model_file_in_a_temp_cwd)
    assert main(["inspect", spec, "--batch-size", "2", "--image-size", "8"]) == 0, capsys.readouterr().err
    assert "model              ThreeBranches" in capsys.readouterr().out
    assert sys.path == path_before  # the current folder is on sys.path for that import only


def test_a_spec_that_cannot_be_imported_says_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "not_here:make"]) == 2
    err = capsys.readouterr().err
    assert f"not_here.py must be in the current folder ({tmp_path}) or on PYTHONPATH" in err


def _all_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {"concur": parser.format_help(), **{name: sub.format_help() for name, sub in _subparsers(parser).items()}}


def test_help_text_has_no_raw_markup():
    for command, text in _all_help(build_parser()).items():
        assert "``" not in text, f"concur {command} --help shows reStructuredText: {text}"
    assert "The concur command: inspect a model's plan" in build_parser().format_help()


def test_inspect_help_says_it_prints_a_summary_not_the_dag():
    parser = build_parser()
    listed = re.search(r"^\s+inspect\s+(.*)$", parser.format_help(), re.M)[1]
    assert "summary" in listed and not listed.startswith("print the DAG")
    own = " ".join(_subparsers(parser)["inspect"].format_help().split())
    assert "print a summary of its DAG" in own and "The DAG itself is not printed" in own


def test_faster_streams_names_the_fastest_count_when_it_is_not_the_one_asked_for():
    googlenet = {1: 1.0, 2: 1.42, 3: 1.59, 4: 1.55}  # concur demo's prediction on an H100
    assert cli.faster_streams(googlenet, 4) == ("3 streams are predicted faster than the 4 asked for "
                                                "(1.59x against 1.55x): try --streams 3")
    assert cli.faster_streams(googlenet, 3) == ""
    assert cli.faster_streams({1: 1.0, 2: 1.331, 3: 1.334}, 2) == ""  # equal as printed: no advice
    assert "try --streams 2" in cli.faster_streams({1: 1.0, 2: 1.5, 3: 1.5, 4: 1.2}, 4)  # the fewest of equals


def test_inspect_says_when_another_stream_count_is_predicted_faster(model_file_in_a_temp_cwd, capsys):
    spec = f"{model_file_in_a_temp_cwd}:make"
    assert main(["inspect", spec, "--batch-size", "2", "--image-size", "8", "--streams", "2"]) == 0
    out = capsys.readouterr().out
    predicted = _speedups(out)
    assert predicted[3] > predicted[2]  # three branches: a third stream helps
    assert out.rstrip().endswith("try --streams 3") and "3 streams are predicted faster than the 2 asked for" in out
    assert main(["inspect", spec, "--batch-size", "2", "--image-size", "8", "--streams", "3"]) == 0
    assert "predicted faster" not in capsys.readouterr().out


def test_report_says_whether_the_run_directory_is_missing_or_lacks_run_json(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    for run_dir, wrong in (("missing", "does not exist"), ("a_file", "is not a directory"), (".", "holds no run.json")):
        assert main(["report", str(tmp_path / run_dir)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"concur report: error: {tmp_path / run_dir} {wrong}: pass the directory"), err
        assert err.count("\n") == 1


def test_every_subcommand_has_a_one_line_summary_and_a_description():
    parser = build_parser()
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    listed = {choice.dest: choice.help for choice in action._choices_actions}
    for command, sub in _subparsers(parser).items():
        assert listed.get(command) and "\n" not in listed[command], command
        assert sub.description, f"concur {command} --help says nothing about what {command} does"


def _options_in_the_guide() -> dict[str, str]:
    """Return each option of the guide's table for demo and inspect, with its meaning."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "cli.md").read_text()
    table = guide.split("Options of `demo` and `inspect`:", 1)[1].split("\n\n", 2)[1]
    return dict(re.findall(r"^\| `(--[a-z-]+)[^|]*\| (.*) \|$", table, re.M))


def test_the_guide_lists_the_options_demo_and_inspect_accept():
    subparsers = _subparsers(build_parser())
    accepted = {command: {o for a in subparsers[command]._actions for o in a.option_strings if o.startswith("--")}
                for command in ("demo", "inspect")}
    guide = _options_in_the_guide()
    assert "--input-shape" in guide and "--scheduler" in guide
    for option, meaning in guide.items():
        only = re.search(r"\(`(\w+)` only\)", meaning)
        for command in [only[1]] if only else accepted:
            assert option in accepted[command], f"the guide lists {option} for concur {command}, which rejects it"
    assert accepted["demo"] | accepted["inspect"] <= set(guide) | {"--help"}


def test_demo_takes_the_scheduler_like_inspect(capsys):
    assert main(["demo", *TINY, "--scheduler", "fork"]) == 0
    out = capsys.readouterr().out
    assert "scheduler fork:" in out and "-> OK" in out


ONE_CHANNEL = """
import torch.nn as nn


def make():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(1))


def mlp():
    return nn.Sequential(nn.Linear(10, 4), nn.ReLU(), nn.Linear(4, 2))
"""


@pytest.mark.parametrize("factory, good, bad", [("make", "1,8,8", "3,8,8"), ("mlp", "10", "9")])
def test_input_shape_gives_the_example_input_of_a_model_that_takes_no_rgb_image(
        factory, good, bad, tmp_path, monkeypatch, capsys):
    model_file = tmp_path / "one_channel.py"
    model_file.write_text(ONE_CHANNEL)
    monkeypatch.chdir(tmp_path)
    spec = [f"{model_file}:{factory}", "--batch-size", "2"]
    assert main(["inspect", *spec]) == 2  # a 3-channel image by default: the model's own shape error
    err = capsys.readouterr().err
    assert "failed on a 2x3x224x224 input" in err and "with --input-shape" in err and err.count("\n") == 1
    assert main(["inspect", *spec, "--input-shape", good]) == 0, capsys.readouterr().err
    shape = good.replace(",", "x")
    assert capsys.readouterr().out.startswith(f"{model_file}:{factory}, batch 2, input {shape}, train mode")
    assert main(["demo", *spec, "--input-shape", good]) == 0
    assert "-> OK" in capsys.readouterr().out
    assert main(["inspect", *spec, "--input-shape", bad]) == 2
    err = capsys.readouterr().err
    assert f"failed on a 2x{bad.replace(',', 'x')} input" in err and "check --input-shape" in err


def test_input_shape_is_whole_numbers_and_not_with_image_size(capsys):
    for argv in (["--input-shape", "1,a"], ["--input-shape", "0,3"], ["--input-shape", "3", "--image-size", "8"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["inspect", *argv])
        assert exit_.value.code == 2 and "--input-shape" in capsys.readouterr().err
    assert build_parser().parse_args(["inspect", "--input-shape", "1x28x28"]).input_shape == (1, 28, 28)


@pytest.fixture
def model_files_outside_the_current_folder(tmp_path, monkeypatch):
    """A model file that imports a module beside it, in a folder that is not the current one."""
    suffix = tmp_path.name.replace("-", "_")
    folder = tmp_path / "my models"  # no Python name: a dotted import could not reach it
    folder.mkdir()
    (folder / f"widths_{suffix}.py").write_text("WIDTH = 8\n")
    (folder / f"net_{suffix}.py").write_text(
        f"from widths_{suffix} import WIDTH\n" + THREE_BRANCHES.replace("Conv2d(3, 8,", "Conv2d(3, WIDTH,"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    yield folder / f"net_{suffix}.py"
    for name in (f"net_{suffix}", f"widths_{suffix}"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("form", ["absolute", "relative"])
def test_a_model_file_outside_the_current_folder_is_imported_from_its_path(
        form, model_files_outside_the_current_folder, capsys):
    path = model_files_outside_the_current_folder
    spec = f"{path if form == 'absolute' else os.path.join('..', 'my models', path.name)}:make"
    path_before = list(sys.path)
    assert main(["inspect", spec, "--batch-size", "2", "--image-size", "8"]) == 0, capsys.readouterr().err
    assert "model              ThreeBranches" in capsys.readouterr().out
    assert sys.path == path_before  # the file's folder is on sys.path for that import only


def test_a_model_file_that_is_not_there_is_named(tmp_path, capsys):
    assert main(["inspect", f"{tmp_path / 'nothing_here.py'}:make"]) == 2
    assert f"names the file {tmp_path / 'nothing_here.py'}, which does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("source, says", [
    ("import torch\nimport concur_test_no_such_package\n", "{file}:2: it imports 'concur_test_no_such_package', "
                                                              "which Python cannot find: install it"),
    ("import torch\ndef make(:\n    pass\n", "{file}:2 has a syntax error (invalid syntax): fix it"),
    ("import torch\nraise RuntimeError('no GPU, no model')\n", "{file}:2: RuntimeError: no GPU, no model: fix that line"),
    ("def make():\n    raise ValueError('bad config')\n", "make() of {spec} raised at {file}:2: ValueError: bad config"),
])
def test_a_model_file_that_fails_says_what_failed_where_and_exits_2(source, says, tmp_path, monkeypatch, capsys):
    name = f"failing_{tmp_path.name.replace('-', '_')}"
    model_file = tmp_path / f"{name}.py"
    model_file.write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for spec in (f"{name}:make", f"{model_file}:make"):
        try:
            assert main(["inspect", spec]) == 2
        finally:
            sys.modules.pop(name, None)
        err = capsys.readouterr().err
        assert err.startswith("concur inspect: error: ") and err.count("\n") == 1, err
        assert says.format(file=model_file, spec=spec) in err and "must be in the current folder" not in err

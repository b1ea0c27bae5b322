"""concur.observe.report on a recorded run fixture: HTML, JSON and plots agree with the run; the CLI; without matplotlib."""

from __future__ import annotations

import json
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from concur.cli import main
from concur.observe.report import write_report
from concur.observe.rundir import load_run
from concur.observe.tune_cache import TunerCache

FIXTURES = Path(__file__).parent / "fixtures"
RUN = FIXTURES / "run_small"


class Cells(HTMLParser):
    """Collects (data-key, text) of every element carrying a data-key, and the embedded images."""

    def __init__(self):
        super().__init__()
        self.cells, self.images, self._key, self._text = [], [], None, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-key" in attrs:
            self._key, self._text = attrs["data-key"], []
        if tag == "img":
            self.images.append(attrs["src"])

    def handle_data(self, data):
        if self._key is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if self._key is not None and tag in ("td", "span"):
            self.cells.append((self._key, "".join(self._text)))
            self._key = None


def lookup(data, key: str):
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    html_path = write_report(RUN, out)
    return out, html_path, json.loads((out / "report.json").read_text())


def test_report_writes_html_json_pngs_and_the_traces_for_perfetto(report):
    out, html_path, data = report
    assert html_path == out / "index.html" and html_path.stat().st_size > 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["googlenet_b8_gantt.png", "googlenet_b8_steptime.png", "googlenet_b8_utilization.png",
                    "inception_v3_b8_steptime.png", "summary_speedup.png"]
    for name in ("traces/googlenet_b8_serial_graph.json.gz", "traces/googlenet_b8_concur_4_streams.json.gz"):
        assert (out / name).read_bytes() == (RUN / name).read_bytes()
    assert [c["name"] for c in data["cases"]] == ["googlenet b8", "inception_v3 b8"]


def test_plots_are_not_blank(report):
    from matplotlib.image import imread

    out, _, _ = report
    for png in out.glob("*.png"):
        pixels = imread(png)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 300, png.name
        assert pixels[..., :3].std() > 0.05, f"{png.name} looks blank"
        assert (pixels[..., :3] < 0.9).mean() > 0.01, f"{png.name} has almost nothing drawn"


def test_every_number_in_the_html_is_the_number_in_the_json(report):
    _, html_path, data = report
    parser = Cells()
    parser.feed(html_path.read_text())
    assert len(parser.cells) > 100
    checked = 0
    for key, text in parser.cells:
        value = lookup(data, key)
        if value is None:
            assert text == "–", key
        elif isinstance(value, bool):
            assert text == ("yes" if value else "NO"), key
        elif isinstance(value, (int, float)):
            number = re.fullmatch(r"(-?[\d.]+)(x|%)?", text)
            assert number, f"{key}: {text!r}"
            decimals = len(number.group(1).split(".")[1]) if "." in number.group(1) else 0
            assert abs(float(number.group(1)) - value) <= 0.5 * 10 ** -decimals + 1e-9, f"{key}: {text} vs {value}"
            checked += 1
        else:
            assert text == str(value), key
    assert checked > 60
    keys = {k for k, _ in parser.cells}
    for expected in ("summary.0.tuned_vs_best", "summary.0.within_5pct", "cases.0.variants.4.median_ms",
                     "cases.0.overlap.1.overlap", "cases.0.phases.0.utilization",
                     "cases.0.monitor.sampler_cpu_percent", "cases.0.tuner.trials.0.median_ms"):
        assert expected in keys, expected


def test_report_numbers_come_from_the_run(report):
    _, _, data = report
    s = data["summary"][0]
    assert s["best_fixed"] == "4 streams" and s["best_fixed_ms"] == 3.80
    assert s["tuned_vs_best"] == pytest.approx(3.83 / 3.80) and s["within_5pct"] is True
    assert s["best_fixed_vs_serial"] == pytest.approx(4.97 / 3.80) and s["lever"] == "capture"
    case = data["cases"][0]
    assert [p["label"] for p in case["phases"]] == ["eager", "serial graph", "concur 4 streams"]
    assert case["phases"][0]["utilization"] == 25.0 and case["phases"][1]["utilization"] == 100.0
    assert case["overlap"][1]["overlap"] == pytest.approx(1352 / 452)
    assert case["variants"][6]["error"].startswith("RuntimeError") and case["variants"][6]["vs_serial"] is None


def test_every_plot_written_is_embedded_in_the_page(report):
    out, html_path, _ = report
    parser = Cells()
    parser.feed(html_path.read_text())
    assert len(parser.images) == len(list(out.glob("*.png")))
    assert all(src.startswith("data:image/png;base64,") for src in parser.images)


def test_a_tuner_choice_more_than_5_percent_off_is_flagged(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(RUN, run_dir)
    raw = json.loads((run_dir / "run.json").read_text())
    raw["cases"][0]["variants"][-1]["median_ms"] = 4.2
    (run_dir / "run.json").write_text(json.dumps(raw))
    html_path = write_report(run_dir)
    assert html_path == run_dir / "report" / "index.html"
    data = json.loads((run_dir / "report" / "report.json").read_text())
    assert data["summary"][0]["within_5pct"] is False
    assert '<td data-key="summary.0.within_5pct">NO</td>' in html_path.read_text()


def test_report_of_a_missing_run_dir_says_what_it_expects(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory"):
        load_run(tmp_path)


# --- CLI ---------------------------------------------------------------------------------------------------

def test_cli_report_and_cache_clear(tmp_path, capsys):
    assert main(["report", str(RUN), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "index.html").exists() and "report written" in capsys.readouterr().out
    TunerCache(tmp_path / "c").put("k1", {"x": 1})
    TunerCache(tmp_path / "c").put("k2", {"x": 2})
    assert main(["cache", "list", "--dir", str(tmp_path / "c")]) == 0
    assert "2 cached" in capsys.readouterr().out
    assert main(["cache", "clear", "--dir", str(tmp_path / "c")]) == 0
    assert "removed 2" in capsys.readouterr().out and TunerCache(tmp_path / "c").entries() == []


def test_without_matplotlib_the_report_keeps_its_tables_and_warns_once(tmp_path, monkeypatch):
    from concur.observe import report as report_module

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr(report_module._plot, "warned", False)
    with pytest.warns(RuntimeWarning, match="matplotlib is not installed") as caught:
        html_path = write_report(RUN, tmp_path)
    assert len(caught) == 1 and list(tmp_path.glob("*.png")) == []
    page = html_path.read_text()
    assert 'data-key="summary.0.tuned_vs_best"' in page and "data:image/png" not in page


def test_utilization_plot_gives_a_phase_one_colour_in_every_panel(tmp_path, monkeypatch):
    """A phase with utilization but no samples must not shift the other phases' colours in the lower panels."""
    from concur.observe import report
    from concur.observe.monitor import Mark, MonitorRecord, Sample, UtilizationSample

    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    record = MonitorRecord(available=True, device="gpu", duration_s=2.0,
                           samples=[Sample(1.2, 500.0, 1980.0, 300.0), Sample(1.6, 510.0, 1980.0, 300.0)],
                           utilization=[UtilizationSample(0.2, 20.0), UtilizationSample(1.3, 98.0)],
                           marks=[Mark(0.0, "first, no samples"), Mark(1.0, "second")])
    assert report.plot_utilization(record, "t", tmp_path / "u.png") == tmp_path / "u.png"
    util, clock, memory = figures[0].axes
    colour = lambda ax, label: next(line.get_color() for line in ax.get_lines() if line.get_label() == label)  # noqa: E731
    assert colour(util, "second") == colour(clock, "second") == colour(memory, "second") == "C1"
    assert "device memory" in memory.get_ylabel()


def test_each_trial_says_how_its_step_ran(report):
    """The tuner notes each trial's TrainStep.status ("runs ..."): the report shows it beside the trial's time."""
    out, html_path, data = report
    trial = data["cases"][0]["tuner"]["trials"][0]
    assert trial["runs"] == "captured, 1 stream (1 capture)"
    parser = Cells()
    parser.feed(html_path.read_text())
    assert ("cases.0.tuner.trials.0.runs", "captured, 1 stream (1 capture)") in parser.cells

"""experiments/results/ stays small: the working tree travels to the GPU machine under a 64 MiB limit.

Rule: under 5 MB in all, no file over 1 MB, and every file is a ``results.jsonl``, ``summary.md`` or
``README.md``, or is named by its relative path in a ``README.md``/``summary.md`` of its directory or a
directory above it (inside experiments/results/), or by ``results/<path>`` in experiments/RESULTS.md.
Raw traces, NVML samples and the ``results.json``/``results.csv`` copies a sweep also writes are dropped
before committing (git history keeps them).
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
RESULTS_MD = ROOT / "experiments" / "RESULTS.md"

MAX_TOTAL = 5_000_000
MAX_FILE = 1_000_000
ALWAYS_KEPT = {"results.jsonl", "summary.md", "README.md"}


def _files():
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def test_results_are_small():
    sizes = {p.relative_to(RESULTS).as_posix(): p.stat().st_size for p in _files()}
    total = sum(sizes.values())
    assert total < MAX_TOTAL, f"experiments/results/ holds {total / 1e6:.1f} MB; keep it under {MAX_TOTAL / 1e6:.0f} MB"
    big = {name: size for name, size in sizes.items() if size > MAX_FILE}
    assert not big, f"files over {MAX_FILE / 1e6:.0f} MB under experiments/results/: {big}"


def test_every_result_file_is_used():
    notes = {md: md.read_text() for md in RESULTS.rglob("*.md") if md.name in ("README.md", "summary.md")}
    results_md = RESULTS_MD.read_text()
    unused = []
    for path in _files():
        if path.name in ALWAYS_KEPT:
            continue
        named = f"results/{path.relative_to(RESULTS).as_posix()}" in results_md
        for md, text in notes.items():
            if named:
                break
            if md.parent in path.parents:
                named = path.relative_to(md.parent).as_posix() in text
        if not named:
            unused.append(path.relative_to(RESULTS).as_posix())
    assert not unused, ("files under experiments/results/ that no README.md, summary.md or RESULTS.md names "
                        f"(drop them, or name them in the run's README.md): {unused}")


def test_result_links_resolve():
    """Markdown links and images in the results' notes and in RESULTS.md point at files that exist."""
    broken = []
    for md in [RESULTS_MD, *RESULTS.rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target:
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not broken, f"broken links: {broken}"

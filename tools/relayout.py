#!/usr/bin/env python
"""Move concur's flat modules into subpackages, one per product, and rewrite every reference (issue 21, item 3).

Run once, from the repository root, with the project's interpreter::

    .venv/bin/python tools/relayout.py            # move, rewrite, then verify
    .venv/bin/python tools/relayout.py --dry-run  # print what would change; touch nothing
    .venv/bin/python tools/relayout.py --verify   # only the checks (e.g. after the move)

What it does, in order, and only after every precondition holds:

1. refuses to start if ``concur/`` holds a module the mapping below does not place (it lists
   them: add each to ``MOVES`` or ``STAY``), if a target already exists, or if the layout is
   half applied; if the layout is already fully applied it only verifies (idempotent);
2. rewrites, in memory, every relative import inside ``concur/`` to its absolute form
   (``from .graph import x`` in ``concur/aten_dag.py`` -> ``from concur.dag.hazards import x``),
   so no relative import needs recomputing for its new depth;
3. rewrites ``from concur import plan as p`` into ``from concur.fx import plan as p``, and every
   dotted reference ``concur.<old>`` (imports, attribute paths, ``monkeypatch`` strings,
   ``sys.modules[...]``, ``:mod:`` roles, mkdocstrings ``::: concur.x`` lines) and path
   ``concur/<old>.py`` in concur/, tests/, experiments/ (not its dated results), examples/,
   docs/, schedulers/ (docstrings), README.md, mkdocs.yml and .ci/run;
   checks that every rewritten Python file still parses, and only then writes;
4. ``git mv`` each module, adds the subpackages' ``__init__.py`` and the two shims below;
5. replaces the "layout today"/"target layout" sections of docs/architecture.md with the
   layout as it now is (jobs taken from the old table, else from each module's docstring);
6. verifies: every module imports (in a fresh interpreter, from this tree, not an installed
   copy), ``concur.api._rebuild`` and the ``torch_dynamo_backends`` entry point load,
   ``concur.backend`` is still the function, no leftover old module name, every ``concur`` import
   in the rewritten files names an existing module and name (read statically, so experiments and
   GPU-only scripts are covered), no string in concur/ names a file that is gone, and the import graph
   (built with ``ast`` from the rewritten sources, lazy imports included) has no cycle and no
   import running up the layers (``LAYERS``) other than the known one, which it reports.

Two names stay at the top as shims, so nothing outside the repository breaks:

* ``concur/api.py`` re-exports :mod:`concur.fx.module`: checkpoints pickled before the move
  name ``concur.api._rebuild``;
* ``concur/backend.py`` re-exports :mod:`concur.inductor.backend`: the installed entry point
  is ``concur.backend:concur_backend`` (no reinstall needed). ``concur/__init__.py`` keeps
  importing ``backend`` through it, so the attribute ``concur.backend`` stays the function
  (importing the shim later, as the entry point does, would otherwise rebind it to the module).
  ``concur.backend`` in prose and calls (``concur.backend(streams=4)``) is the function and
  is left as is; only module uses (imports, ``concur.backend.X``, ``sys.modules``,
  ``import_module``, ``:mod:``) are rewritten.

``concur._torch_compat`` keeps its name and place. Messages that start with a module name
(``"concur.monitor: no GPU metrics"``) keep it: they are what users and the troubleshooting
page match on.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# --------------------------------------------------------------------------------------------
# The mapping: old module (file stem in concur/) -> new dotted module.
MOVES: dict[str, str] = {
    # dag/: what both paths share
    "annotate": "concur.dag.annotate",
    "graph": "concur.dag.hazards",
    "cost": "concur.dag.cost",
    # the stream runtime both paths apply plans with
    "runtime": "concur.streams",
    # fx/: the unfused path
    "capture": "concur.fx.capture",
    "plan": "concur.fx.plan",
    "codegen": "concur.fx.codegen",
    "verify": "concur.fx.verify",
    "api": "concur.fx.module",
    # inductor/: the torch.compile backend
    "backend": "concur.inductor.backend",
    "aten_dag": "concur.inductor.aten_dag",
    "kernel_program": "concur.inductor.wrapper_parse",
    "kernel_streams": "concur.inductor.wrapper_emit",
    "inductor_streams": "concur.inductor.stamp",
    # training/: the captured training step
    "train": "concur.training.step",
    "captured_optim": "concur.training.captured_optim",
    # observe/: measuring, tuning, reporting
    "monitor": "concur.observe.monitor",
    "timing": "concur.observe.timing",
    "profile_trace": "concur.observe.profile_trace",
    "rundir": "concur.observe.rundir",
    "report": "concur.observe.report",
    "tune_cache": "concur.observe.tune_cache",
    "tuner": "concur.observe.tuner",
}
STAY = ("__init__", "__main__", "cli", "errors", "zoo", "_torch_compat")

SUBPACKAGES: dict[str, str] = {
    "dag": "What both paths share: the facts of each operation (storages read and written, RNG, FLOPs,\n"
           "bytes), the dependency DAG with its hazard edges, and what each operation costs.",
    "fx": "The unfused path: ``concur.optimize`` and ``concur.inspect``. A model is traced with torch.fx,\n"
          "annotated, turned into a DAG, scheduled, and compiled back into an fx module whose forward\n"
          "switches streams and records and waits on events; the generated code is verified before it runs.",
    "inductor": "The ``torch.compile`` backend ``\"concur\"``: inductor compiles and fuses each graph whole, and\n"
                "concur puts the fused kernels on streams, by rewriting the generated wrapper's ``call`` or\n"
                "by stamping streams onto the aten graph for inductor's own stream support (torch >= 2.13).",
    "training": "The training runtime: ``concur.train_step``, a whole training step (forward, loss, backward,\n"
                "optimizer) captured in one CUDA graph, on streams, with optimizer hyperparameters read\n"
                "from device tensors so learning-rate schedules reach the captured graph.",
    "observe": "Measuring, tuning and reporting: the NVML monitor, timing, profiler traces, run directories,\n"
               "``concur report``, and the measured tuner behind ``streams=\"auto\"`` with its disk cache.",
}

SHIMS: dict[str, str] = {
    "api": '''"""Former home of ``optimize``, ``inspect`` and ``ConcurModule``, which live in :mod:`concur.fx.module`.

Kept because checkpoints pickled before the move name ``concur.api._rebuild``.
"""

from concur.fx.module import *  # noqa: F401,F403
from concur.fx.module import _rebuild  # noqa: F401
''',
    "backend": '''"""The name of the ``torch_dynamo_backends`` entry point (``concur.backend:concur_backend``).

The backend lives in :mod:`concur.inductor.backend`; this module keeps installed metadata working.
``concur/__init__.py`` imports ``backend`` through here so that the attribute ``concur.backend``
is the function, not this module.
"""

from concur.inductor.backend import *  # noqa: F401,F403
from concur.inductor.backend import backend, concur_backend  # noqa: F401
''',
}

# Layers, from the bottom (0) up: an import may only point to the same or a lower layer.
# Matched by longest prefix. fx and inductor share a layer but must not import each other.
LAYERS: dict[str, int] = {
    "concur._torch_compat": 0, "concur.errors": 0, "concur.zoo": 0,
    "concur.dag": 1,
    "concur.streams": 2,
    "concur.fx": 3, "concur.inductor": 3,
    "concur.fx.module": 4,
    "concur.observe": 5,
    "concur.training": 6,
    "concur.api": 7, "concur.backend": 7,
    "concur": 8, "concur.__main__": 8, "concur.cli": 8,
}
SEPARATE = (("concur.fx", "concur.inductor"),)
# Known upward import (importer, imported), reported but not fatal: the tuner builds train
# steps to time them, and train_step(streams="auto") calls the tuner. Fix: the tuner takes
# a step factory (train_step passes itself), so concur.observe never imports concur.training.
KNOWN_UPWARD = {("concur.observe.tuner", "concur.training.step")}

# Where references are rewritten (relative to the root). Dated results are history: left alone.
TEXT_ROOTS = ("concur", "tests", "experiments", "examples", "docs", "schedulers")
TEXT_FILES = ("README.md", "mkdocs.yml", ".ci/run")
TEXT_SUFFIXES = (".py", ".md", ".yml", ".yaml", ".sh", ".txt", ".cfg", ".toml", ".ini")
EXCLUDED_DIRS = ("experiments/results", "tests/fixtures/wrappers", "__pycache__")
EXCLUDED_FILES = ("tests/test_layout.py",)  # it names the shims (concur.api, concur.backend) on purpose
QUICK_TESTS = ("tests/test_layout.py", "tests/test_schedulers.py", "tests/test_graph.py", "tests/test_api.py",
               "tests/test_kernel_streams.py", "tests/test_cli.py")


class RelayoutError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"relayout: {message}")


def new_path(dotted: str) -> str:
    """Return the file of a dotted module: concur.dag.hazards -> concur/dag/hazards.py."""
    return dotted.replace(".", "/") + ".py"


# --------------------------------------------------------------------------------------------
# Rewriting

def _char_col(line: str, byte_col: int) -> int:
    """ast columns count UTF-8 bytes; return the character index."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _offset(lines: list[str], lineno: int, byte_col: int) -> int:
    """Absolute character offset of (1-based line, byte column) in the text split by keepends."""
    return sum(len(l) for l in lines[:lineno - 1]) + _char_col(lines[lineno - 1], byte_col)


def _package_of(rel: str) -> list[str]:
    """The package a file's relative imports start from: concur/x.py and concur/__init__.py -> [concur]."""
    return rel[:-3].split("/")[:-1]


def absolutize(text: str, rel: str) -> str:
    """Rewrite the relative imports of concur/<rel> to absolute ones, computed from its current place."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    package = _package_of(rel)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level > len(package):
                raise RelayoutError(f"{rel}:{node.lineno}: relative import beyond the top package")
            base = package[:len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            start = _offset(lines, node.lineno, node.col_offset)
            m = re.compile(r"from\s+\.+\s*[\w.]*\s+import\b").match(text, start)
            if not m:
                raise RelayoutError(f"{rel}:{node.lineno}: cannot read this relative import; rewrite it by hand")
            edits.append((m.start(), m.end(), f"from {target} import"))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def split_from_concur(text: str, rel: str, moves: dict[str, str]) -> str:
    """``from concur import tuner, errors`` -> ``from concur import errors`` + ``from concur.observe import tuner``.

    ``backend`` is left alone: ``from concur import backend`` is the public function.
    """
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "concur"):
            continue
        moved = [a for a in node.names if a.name in moves and a.name != "backend"]
        if not moved:
            continue
        kept = [a for a in node.names if a not in moved]
        stmts = []
        if kept:
            stmts.append("from concur import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "")
                                                          for a in kept))
        for a in moved:
            parent, leaf = moves[a.name].rsplit(".", 1)
            local = a.asname or a.name
            stmts.append(f"from {parent} import {leaf}" + (f" as {local}" if local != leaf else ""))
        start = _offset(lines, node.lineno, node.col_offset)
        end = _offset(lines, node.end_lineno, node.end_col_offset)
        prefix = lines[node.lineno - 1][:_char_col(lines[node.lineno - 1], node.col_offset)]
        joiner = "\n" + prefix if prefix.strip() == "" else "; "
        edits.append((start, end, joiner.join(stmts)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _backend_is_module(text: str, m: re.Match, in_init: bool) -> bool:
    """True where ``concur.backend`` names the module rather than the function ``concur.backend``."""
    line_start = text.rfind("\n", 0, m.start()) + 1
    before = text[line_start:m.start()]
    after = text[m.end():m.end() + 2]
    if re.match(r"\.\w", after):  # concur.backend.ConcurBackend, "concur.backend.x"
        return True
    if re.fullmatch(r"\s*(from|import)\s+", before):
        return not in_init  # __init__ imports the function through the shim, see the module docstring
    if before.endswith(":mod:`"):
        return True
    if re.search(r"(import_module\(|modules\[|modules\.get\()\s*[\"']$", before):
        return True
    return False


def rewrite_refs(text: str, moves: dict[str, str], in_init: bool = False) -> str:
    """Rewrite dotted references ``concur.<old>`` and paths ``concur/<old>.py`` to their new homes."""
    names = "|".join(sorted(map(re.escape, moves), key=len, reverse=True))

    def dotted(m: re.Match) -> str:
        old = m.group(1)
        if text[m.end():m.end() + 2] == ": ":  # a message prefix, "concur.monitor: no GPU metrics"
            return m.group(0)
        if old == "api" and text.startswith("._rebuild", m.end()):  # the name pickles hold
            return m.group(0)
        if old == "backend" and not _backend_is_module(text, m, in_init):
            return m.group(0)
        return moves[old]

    def path(m: re.Match) -> str:
        return new_path(moves[m.group(1)])

    text = re.sub(rf"(?<![\w.]){'concur'}\.({names})(?!\w)", dotted, text)
    return re.sub(rf"(?<![\w./-])concur/({names})\.py(?!\w)", path, text)


_FROM_CONCUR = re.compile(r"^([ \t]*)from (concur[\w.]*) import [^()\\;]*$")


def sort_import_runs(text: str) -> str:
    """Sort each run of consecutive one-line ``from concur... import`` statements by module, as isort would."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FROM_CONCUR.match(lines[i])
        j = i + 1
        while m and j < len(lines) and (n := _FROM_CONCUR.match(lines[j])) and n.group(1) == m.group(1):
            j += 1
        if m and j - i > 1:
            lines[i:j] = sorted(lines[i:j], key=lambda l: _FROM_CONCUR.match(l).group(2))
        i = j
    return "\n".join(lines)


def rewrite_file_literals(text: str, rel: str, moves: dict[str, str]) -> tuple[str, list[str]]:
    """In concur/<rel>, rewrite string literals that are a bare module file name ("graph.py").

    Such a name is joined with the module's own folder (inductor_streams' pass hashes its
    sources), so it becomes the path from the module's new folder: "graph.py" in
    concur/inductor/stamp.py -> "../dag/hazards.py". Returns the text and one note per change.
    """
    stem = Path(rel).stem
    here = Path(new_path(moves[stem])).parent if stem in moves else Path(rel).parent
    names = "|".join(sorted(map(re.escape, moves), key=len, reverse=True))
    notes = []

    def sub(m: re.Match) -> str:
        target = os.path.relpath(new_path(moves[m.group(2)]), here).replace(os.sep, "/")
        notes.append(f"{rel}: file name {m.group(0)} -> {m.group(1)}{target}{m.group(1)} (review)")
        return f"{m.group(1)}{target}{m.group(1)}"

    return re.sub(rf"""(["'])({names})\.py\1""", sub, text), notes


# Edits the general rules cannot decide, applied where the old text is found (else reported).
SPECIAL_EDITS = (
    # the backend function is now defined in concur.inductor.backend (the entry point keeps its name)
    ("tests/test_backend.py", '== ["concur.backend", "concur_backend"]', '== ["concur.inductor.backend", "concur_backend"]'),
)


def leftovers(text: str, moves: dict[str, str], in_init: bool = False, py: bool = False) -> list[tuple[int, str]]:
    """Lines still naming an old module as a module (what the rewrite would change)."""
    out = []
    new = rewrite_refs(split_from_concur(text, "", moves) if py else text, moves, in_init)
    for i, (a, b) in enumerate(zip(text.splitlines(), new.splitlines()), 1):
        if a != b:
            out.append((i, a.strip()))
    return out


# --------------------------------------------------------------------------------------------
# The import graph

def module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, dict[str, list[tuple[int, bool]]]]:
    """{importer: {imported: [(line, lazy)]}} over concur's modules, lazy (in-function) imports included."""
    files = {module_name(p.relative_to(root).as_posix()): p for p in sorted((root / "concur").rglob("*.py"))
             if "__pycache__" not in p.parts}
    graph: dict[str, dict[str, list[tuple[int, bool]]]] = {m: {} for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"
        package = mod.split(".") if is_pkg else mod.split(".")[:-1]
        lazy_nodes = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                lazy_nodes.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package[:len(package) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in dict.fromkeys(targets):
                # the deepest existing module named by t (concur.dag.hazards.hazard_edges -> concur.dag.hazards)
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("concur"):
                    where = graph[mod].setdefault(t, [])
                    if (node.lineno, id(node) in lazy_nodes) not in where:
                        where.append((node.lineno, id(node) in lazy_nodes))
    # "import concur.dag.hazards" also runs concur/__init__ and concur/dag/__init__: those are
    # parents, not dependencies in the layering sense, so they are not added.
    return graph


def _top_level_names(path: Path) -> set[str] | None:
    """Names a module binds at its top level (None if it star-imports: anything goes)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    return None
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def unresolved_imports(root: Path, files: list[Path]) -> list[str]:
    """``from concur.x import y`` / ``import concur.x`` in these files that name no module or name."""
    def module_file(dotted: str) -> Path | None:
        base = root / dotted.replace(".", "/")
        return base / "__init__.py" if (base / "__init__.py").exists() else \
            base.with_suffix(".py") if base.with_suffix(".py").exists() else None

    cache: dict[Path, set[str] | None] = {}
    bad = []
    for p in files:
        if p.suffix != ".py":
            continue
        rel = p.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                bad += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names
                        if a.name.split(".")[0] == "concur" and module_file(a.name) is None]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "concur":
                target = module_file(node.module)
                if target is None:
                    bad.append(f"{rel}:{node.lineno}: from {node.module} import ...: no such module")
                    continue
                defined = cache.setdefault(target, _top_level_names(target))
                for a in node.names:
                    if a.name != "*" and defined is not None and a.name not in defined and \
                            module_file(f"{node.module}.{a.name}") is None:
                        bad.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}: not defined there")
    return bad


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def layer(mod: str) -> int | None:
    best = None
    for prefix, rank in LAYERS.items():
        if (mod == prefix or prefix != "concur" and mod.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return None if best is None else best[1]


def layering_problems(graph: dict[str, dict]) -> tuple[list[str], list[str]]:
    """Return (upward or sideways imports, modules in no layer)."""
    bad, unplaced = [], sorted(m for m in graph if layer(m) is None)
    for src in sorted(graph):
        for dst, where in sorted(graph[src].items()):
            if src.startswith(dst + "."):  # a subpackage's module importing its package: not an edge
                continue
            ls, ld = layer(src), layer(dst)
            lines = ", ".join(f"line {n}{' (lazy)' if lazy else ''}" for n, lazy in where)
            if ls is not None and ld is not None and ld > ls:
                bad.append(f"{src} (layer {ls}) imports {dst} (layer {ld}): {lines}")
            for a, b in SEPARATE:
                for x, y in ((a, b), (b, a)):
                    if (src == x or src.startswith(x + ".")) and (dst == y or dst.startswith(y + ".")):
                        bad.append(f"{src} imports {dst} ({x} and {y} are separate products): {lines}")
    return bad, unplaced


# --------------------------------------------------------------------------------------------
# The architecture page

TOP_JOBS = {  # the tree's lines for what stays at the top
    "__init__.py, cli.py, ...": "the front: public names, the concur command, zoo, errors",
    "_torch_compat.py": "the one door to private and version-dependent torch APIs",
    "streams.py": "StreamRuntime: switches, events, waits, for both paths",
    "api.py, backend.py": "shims: old pickles, the installed entry point",
}
SHORT = {"dag": "what both paths share", "fx": "the unfused path (optimize, inspect)",
         "inductor": "the torch.compile backend", "training": "the training runtime (train_step)",
         "observe": "monitor, timing, traces, reports, tuner"}


def _md(text: str) -> str:
    return text.replace("``", "`").replace("\n", " ")


def architecture_section(root: Path, moves: dict[str, str], old_jobs: dict[str, str], schedulers_par: str) -> str:
    def job(stem_old: str | None, dotted: str) -> str:
        if stem_old and stem_old in old_jobs:
            return old_jobs[stem_old]
        src = (root / new_path(dotted)).read_text(encoding="utf-8")
        doc = (ast.get_docstring(ast.parse(src)) or "").strip()
        first = doc.splitlines()[0].rstrip(".") if doc else ""
        return _md(first[:1].lower() + first[1:])

    back = {v: k for k, v in moves.items()}
    tree = ["concur/"] + [f"  {k:<26} {v}" for k, v in TOP_JOBS.items()]
    rows = ["| module | was | job |", "|---|---|---|", "| **top** | | |"]
    top = sorted({s for s in STAY if s != "__main__"} | set(SHIMS) | {v.split(".")[1] for v in moves.values()
                                                                      if v.count(".") == 1})
    for stem in top:
        dotted = "concur" if stem == "__init__" else f"concur.{stem}"
        if stem in SHIMS:
            j = f"shim: re-exports `{moves[stem]}`"
        elif stem == "__init__":
            j = "the public names (`concur.__all__`)"
        else:
            j = job(back.get(dotted, stem), dotted)
        rows.append(f"| `{stem}.py` | {f'`{back[dotted]}.py`' if dotted in back else ''} | {j} |")
    for sub, doc in SUBPACKAGES.items():
        mods = sorted(v for v in moves.values() if v.startswith(f"concur.{sub}."))
        tree.append(f"  {sub + '/':<26} {SHORT.get(sub, '')}")
        tree.append("    " + ", ".join(v.rsplit(".", 1)[1] + ".py" for v in mods))
        rows.append(f"| **`{sub}/`** | | {_md(doc)} |")
        for v in mods:
            rows.append(f"| `{new_path(v)[len('concur/'):]}` | `{back[v]}.py` | {job(back[v], v)} |")
    tree.append(f"{'schedulers/':<28} pure: a costed DAG in, a Schedule out; never imports torch")
    names = []
    for r in sorted(set(LAYERS.values()), reverse=True):
        members = sorted(p for p, x in LAYERS.items() if x == r)
        names.append(", ".join("`" + ("__init__" if m == "concur" else m[len("concur."):].replace(".", "/")) + "`"
                               for m in members))
    return ("## The layout\n\n"
            "One subpackage per product; every import points down the layers, and there is no import\n"
            "cycle (`tests/test_layout.py` checks both, and that `schedulers/` never imports torch).\n\n"
            "```\n" + "\n".join(tree) + "\n```\n\n"
            "Layers from the top: " + " → ".join(names) + ". `fx/` and `inductor/` never import each other.\n\n"
            + "\n".join(rows) + "\n\n" + (schedulers_par.strip() + "\n\n" if schedulers_par else ""))


DIAGRAM_LABELS = (("──kernel_program──▶", "──wrapper_parse───▶"),
                  ("kernel_streams: re-emitted call", "wrapper_emit: re-emitted call"))


def rewrite_architecture(root: Path, text: str, moves: dict[str, str]) -> str | None:
    """Replace the 'layout today' and 'target layout' sections; None if the page is not as expected."""
    start = text.find("## The layout today")
    if start < 0:
        return None
    nxt = text.find("## How it is tested", start)
    if nxt < 0:
        m = re.compile(r"^## (?!The layout today|The target layout)", re.M).search(text, start + 3)
        nxt = m.start() if m else len(text)
    old = text[start:nxt]
    old_jobs = {}
    for m in re.finditer(r"^\|\s*([^|]+?)\s*\|\s*(.+?)\s*\|\s*$", old, re.M):
        files = re.findall(r"`(\w+)\.py`", m.group(1))
        for f in files:
            if len(files) == 1:
                old_jobs[f] = m.group(2)
    par = re.search(r"^`schedulers/`:.*?(?=\n\n)", old, re.M | re.S)
    head = text[:start]
    for a, b in DIAGRAM_LABELS:  # same width, so the drawing stays aligned
        head = head.replace(a, b)
    return head + architecture_section(root, moves, old_jobs, par.group(0) if par else "") + text[nxt:]


# --------------------------------------------------------------------------------------------

def run(cmd: list[str], root: Path, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=root, text=True, capture_output=True, env=env)
    if check and done.returncode:
        raise RelayoutError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return done


def text_files(root: Path) -> list[Path]:
    out = []
    for top in TEXT_ROOTS:
        for p in sorted((root / top).rglob("*")) if (root / top).is_dir() else []:
            rel = p.relative_to(root).as_posix()
            if p.is_file() and p.suffix in TEXT_SUFFIXES and rel not in EXCLUDED_FILES and not any(
                    rel == d or rel.startswith(d + "/") or f"/{d}/" in f"/{rel}" for d in EXCLUDED_DIRS):
                out.append(p)
    out += [root / f for f in TEXT_FILES if (root / f).is_file()]
    return out


def state(root: Path, moves: dict[str, str]) -> str:
    """'old', 'new' or a description of a half-applied layout."""
    old_present = [s for s in moves if (root / "concur" / f"{s}.py").exists() and s not in SHIMS]
    new_present = [v for v in moves.values() if (root / new_path(v)).exists()]
    if not new_present:
        return "old"
    if not old_present:
        return "new"
    return (f"half applied: old modules {old_present} and new modules {new_present} both exist; "
            "restore the tree (git checkout/reset) and run again")


def preflight(root: Path) -> dict[str, str]:
    """Return the moves that apply; raise on anything unplaced or in the way."""
    stems = sorted(p.stem for p in (root / "concur").glob("*.py"))
    unplaced = [s for s in stems if s not in MOVES and s not in STAY]
    dirs = sorted(p.name for p in (root / "concur").iterdir() if p.is_dir() and p.name != "__pycache__"
                  and p.name not in SUBPACKAGES)
    problems = []
    if unplaced:
        problems.append("modules the mapping does not place (add each to MOVES or STAY in tools/relayout.py): "
                        + ", ".join(f"concur/{s}.py" for s in unplaced))
    if dirs:
        problems.append("unexpected folders in concur/: " + ", ".join(dirs))
    missing = [s for s in MOVES if not (root / "concur" / f"{s}.py").exists()]
    for s in missing:
        print(f"relayout: WARNING: concur/{s}.py is gone: skipping {s} -> {MOVES[s]} "
              "(references to it are still rewritten)", file=sys.stderr)
    for s, v in MOVES.items():
        if s not in missing and (root / new_path(v)).exists():
            problems.append(f"{new_path(v)} already exists")
    if problems:
        raise RelayoutError("nothing changed:\n  " + "\n  ".join(problems))
    return {s: v for s, v in MOVES.items()}


def relayout(root: Path, dry_run: bool) -> list[str]:
    moves = preflight(root)
    present = {s for s in moves if (root / "concur" / f"{s}.py").exists()}
    tracked = set(run(["git", "ls-files", "concur"], root).stdout.split())
    notes = []

    # 1-3: compute every new text in memory, check it parses, then write.
    new_texts: dict[Path, str] = {}
    for p in text_files(root):
        rel = p.relative_to(root).as_posix()
        text = p.read_text(encoding="utf-8")
        new = text
        if p.suffix == ".py":
            try:
                if rel.startswith("concur/"):
                    new = absolutize(new, rel)
                new = split_from_concur(new, rel, moves)
            except SyntaxError as exc:
                raise RelayoutError(f"{rel} does not parse ({exc}); fix it and run again")
        new = rewrite_refs(new, moves, in_init=(rel == "concur/__init__.py"))
        if p.suffix == ".py" and rel.startswith("concur/"):
            new, literal_notes = rewrite_file_literals(new, rel, moves)
            notes += literal_notes
        for path_, a, b in SPECIAL_EDITS:
            if rel == path_:
                if a in new:
                    new = new.replace(a, b)
                    notes.append(f"{rel}: {a} -> {b}")
                else:
                    notes.append(f"{rel}: special edit not applied, text not found (check by hand): {a}")
        if p.suffix == ".py" and new != text:
            new = sort_import_runs(new)
            try:
                ast.parse(new)
            except SyntaxError as exc:
                raise RelayoutError(f"rewriting {rel} broke it ({exc}): nothing written")
        if new != text:
            new_texts[p] = new
    if dry_run:
        import difflib
        for p, new in new_texts.items():
            old = p.read_text(encoding="utf-8")
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       str(p.relative_to(root)), str(p.relative_to(root)), n=0))
        print("\n# moves")
        for s in sorted(moves):
            print(f"concur/{s}.py -> {new_path(moves[s])}" + ("" if s in present else "   (missing: skipped)"))
        return notes
    for p, new in new_texts.items():
        p.write_text(new, encoding="utf-8")
    notes.append(f"rewrote references in {len(new_texts)} files")

    # 4: move, add packages and shims.
    for sub, doc in SUBPACKAGES.items():
        d = root / "concur" / sub
        d.mkdir(exist_ok=True)
        init = d / "__init__.py"
        if not init.exists():
            init.write_text('"""' + doc + '\n"""\n', encoding="utf-8")
        run(["git", "add", init.relative_to(root).as_posix()], root)
    for s in sorted(present):
        src, dst = f"concur/{s}.py", new_path(moves[s])
        if src in tracked:
            run(["git", "mv", src, dst], root)
        else:
            os.rename(root / src, root / dst)
            run(["git", "add", dst], root)
            notes.append(f"{src} was untracked: renamed and added")
    for stem, body in SHIMS.items():
        (root / "concur" / f"{stem}.py").write_text(body, encoding="utf-8")
        run(["git", "add", f"concur/{stem}.py"], root)

    # 5: the architecture page.
    page = root / "docs" / "architecture.md"
    if page.exists():
        new = rewrite_architecture(root, page.read_text(encoding="utf-8"), moves)
        if new is None:
            notes.append("docs/architecture.md has no '## The layout today' section: draw the layout by hand")
        else:
            page.write_text(new, encoding="utf-8")
            notes.append("docs/architecture.md: layout sections replaced by the layout as it now is")
    return notes


IMPORT_CHECK = textwrap.dedent(r"""
    import importlib, importlib.metadata, pathlib, pkgutil, sys
    root = pathlib.Path(sys.argv[1]).resolve()
    import concur
    assert pathlib.Path(concur.__file__).resolve().is_relative_to(root), f"imported {concur.__file__}, not {root}"
    names = sorted(m.name for m in pkgutil.walk_packages(concur.__path__, "concur.") if m.name != "concur.__main__")
    for name in names:
        importlib.import_module(name)
    import concur.api
    assert callable(concur.api._rebuild), "concur.api._rebuild"
    assert callable(concur.backend) and not isinstance(concur.backend, type(concur)), "concur.backend is a module"
    eps = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "concur"]
    for e in eps:
        assert callable(e.load()), e
    assert callable(concur.backend) and not isinstance(concur.backend, type(concur)), "entry point rebinds concur.backend"
    print(f"imported {len(names)} modules from {root}; entry points: {[e.value for e in eps]}")
""")


def verify(root: Path, quick_tests: bool) -> bool:
    ok = True
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    done = run([sys.executable, "-c", IMPORT_CHECK, str(root)], root, check=False, env=env)
    print(f"[verify] import every module: {'ok' if done.returncode == 0 else 'FAILED'} ({time.time() - t0:.0f} s)")
    print(textwrap.indent((done.stdout + done.stderr).strip()[-4000:], "    "))
    ok &= done.returncode == 0

    graph = import_graph(root)
    found = cycles(graph)
    print(f"[verify] import cycles among {len(graph)} modules (lazy imports included): {len(found) or 'none'}")
    for comp in found:
        print("    cycle: " + " <-> ".join(comp))
        for a in comp:
            for b in comp:
                if b in graph[a]:
                    print(f"      {a} imports {b} at " + ", ".join(
                        f"line {n}{' (in a function)' if lazy else ''}" for n, lazy in graph[a][b]))
    bad, unplaced = layering_problems(graph)
    if unplaced:
        print("[verify] modules in no layer (add them to LAYERS): " + ", ".join(unplaced))
        ok = False
    known = [b for b in bad if any(b.startswith(f"{x} (layer") and f"imports {y} (" in b for x, y in KNOWN_UPWARD)]
    new_bad = [b for b in bad if b not in known]
    print(f"[verify] imports against the layers: {len(new_bad) or 'none'} new, {len(known)} known")
    for b in new_bad:
        print("    " + b)
    for b in known:
        print("    known (issue 21; the tuner should take a step factory): " + b)
    cyc_known = all(set(c) <= {m for e in KNOWN_UPWARD for m in e} for c in found)
    ok &= not new_bad and cyc_known

    unresolved = unresolved_imports(root, text_files(root))
    print(f"[verify] imports of concur in concur/, tests/, experiments/, examples/, docs/ that resolve to nothing "
          f"(read statically): {len(unresolved) or 'none'}")
    for line in unresolved:
        print("    " + line)
    ok &= not unresolved

    dangling = []
    for p in sorted((root / "concur").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"[\w./]+\.py", node.value) and not (p.parent / node.value).exists() and \
                    not (root / node.value).exists():
                dangling.append(f"{p.relative_to(root)}:{node.lineno}: {node.value!r}")
    print(f"[verify] file names in concur/ strings that name no file: {len(dangling) or 'none'}")
    for line in dangling:
        print("    " + line)
    ok &= not dangling

    left = []
    for p in text_files(root):
        rel = p.relative_to(root).as_posix()
        if rel in {f"concur/{stem}.py" for stem in SHIMS}:
            continue
        for n, line in leftovers(p.read_text(encoding="utf-8"), MOVES, in_init=(rel == "concur/__init__.py"),
                                 py=p.suffix == ".py"):
            left.append(f"{rel}:{n}: {line}")
    print(f"[verify] references to old module names left: {len(left) or 'none'}")
    for line in left[:50]:
        print("    " + line)
    ok &= not left

    if quick_tests:
        tests = [t for t in QUICK_TESTS if (root / t).exists()]
        t1 = time.time()
        done = run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], root,
                   check=False, env=env)
        print(f"[verify] pytest {' '.join(tests)}: {'ok' if done.returncode == 0 else 'FAILED'} "
              f"({time.time() - t1:.0f} s)")
        print(textwrap.indent(done.stdout.strip()[-3000:], "    "))
        ok &= done.returncode == 0
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (default: the current folder)")
    ap.add_argument("--dry-run", action="store_true", help="print the rewrites and moves; change nothing")
    ap.add_argument("--verify", action="store_true", help="only run the checks")
    ap.add_argument("--tests", action="store_true", help="also run a few quick test files after verifying")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if not (root / "concur" / "__init__.py").exists() or not (root / ".git").exists():
        raise RelayoutError(f"{root} is not concur's repository root")
    t0 = time.time()
    if not args.verify:
        st = state(root, MOVES)
        if st == "new":
            print("relayout: the layout is already applied; verifying only")
        elif st != "old":
            raise RelayoutError(st)
        else:
            dirty = run(["git", "status", "--porcelain", "--", "concur"], root).stdout.strip()
            if dirty:
                print("relayout: note: uncommitted changes in concur/ are carried along:\n"
                      + textwrap.indent(dirty, "    "))
            for note in relayout(root, args.dry_run):
                print("relayout: " + note)
            if args.dry_run:
                return 0
            print(f"relayout: moved and rewrote in {time.time() - t0:.1f} s")
    ok = verify(root, args.tests)
    print(f"relayout: {'all checks passed' if ok else 'CHECKS FAILED (see above)'} in {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

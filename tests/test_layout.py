"""concur's layout: no import cycle, every import points down the layers, schedulers/ pure.

The import graph is read with ``ast`` from the sources, so nothing is imported to build it. Imports
inside functions count too: a cycle through a lazy import is still two modules that need each other.
The layers are those drawn in docs/architecture.md.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

# From the bottom (0) up: a module may import only from its own layer or a lower one. The longest
# prefix decides; "concur" alone is the package's __init__. fx and inductor never import each other.
LAYERS = {
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, dict[str, int]]:
    """{importer: {imported module: first line}} over the modules of concur/."""
    files = {module_name(p): p for p in sorted((ROOT / "concur").rglob("*.py")) if "__pycache__" not in p.parts}
    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for mod, path in files.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:  # concur.dag.hazards.hazard_edges -> concur.dag.hazards
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):  # a package's __init__ is no dependency
                    graph[mod].setdefault(t, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(mod: str) -> int | None:
    matches = [p for p in LAYERS if mod == p or (p != "concur" and mod.startswith(p + "."))]
    return LAYERS[max(matches, key=len)] if matches else None


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (lazy imports included):\n" + "\n".join(
        " <-> ".join(c) + ": " + ", ".join(f"{a} imports {b} at line {graph[a][b]}" for a in c for b in c
                                          if b in graph[a]) for c in found)


def test_every_module_has_a_layer():
    unplaced = [m for m in import_graph() if layer(m) is None]
    assert not unplaced, f"give these modules a layer in LAYERS (here and in docs/architecture.md): {unplaced}"


def test_imports_point_down_the_layers():
    bad = []
    for src, deps in sorted(import_graph().items()):
        for dst, line in sorted(deps.items()):
            if (layer(dst) or 0) > (layer(src) or 0):
                bad.append(f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)}) at line {line}")
            for a, b in SEPARATE:
                for x, y in ((a, b), (b, a)):
                    if (src == x or src.startswith(x + ".")) and (dst == y or dst.startswith(y + ".")):
                        bad.append(f"{src} imports {dst} at line {line}: {x} and {y} are separate products")
    assert not bad, "imports against the layers (see docs/architecture.md):\n" + "\n".join(bad)


def test_schedulers_import_no_torch():
    bad = []
    for path in sorted((ROOT / "schedulers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in ("torch", "concur")]
    assert not bad, "schedulers/ is pure Python:\n" + "\n".join(bad)


def test_shims_keep_old_names_working():
    import concur

    from concur.api import _rebuild  # the name checkpoints pickled before the move hold
    from concur.fx.module import _rebuild as moved

    assert _rebuild is moved
    importlib.import_module("concur.backend")  # what the torch_dynamo_backends entry point loads
    assert callable(concur.backend) and not inspect.ismodule(concur.backend)
    assert concur.backend is importlib.import_module("concur.inductor.backend").backend

"""concur's layout: no import cycle, every import points down the layers, schedulers/ pure, one door to torch's privates.

The import graph is read with ``ast`` from the sources, so nothing is imported to build it. Imports
inside functions count too: a cycle through a lazy import is still two modules that need each other.
The layers are those drawn in docs/architecture.md. Private torch names (``torch._dynamo``,
``module._parameters``, ``getattr(opt, "_hooks")``) are read only in ``concur/_torch_compat.py``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[1]

# From the bottom (0) up: a module may import only from its own layer or a lower one. The longest
# prefix decides; "concur" alone is the package's __init__. fx and inductor never import each other.
LAYERS = {
    "concur._torch_compat": 0, "concur.errors": 0, "concur.zoo": 0,
    "concur.dag": 1,
    "concur.streams": 2, "concur.caller_memory": 2,
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
    assert concur.backend is importlib.import_module("concur.inductor.stream_backend").backend


# -- one door to torch's private names ---------------------------------------------------------------

COMPAT = "concur._torch_compat"
# The private names concur reads outside _torch_compat.py, by (module, name), and why each may be read
# there; a name ending in "*" stands for every name it starts. Anything else private that a module
# names belongs in _torch_compat.py, behind a check that fails closed.
PRIVATE_ALLOWED = {
    ("concur.training.captured_optim", "_foreach_*"): "torch's multi-tensor ops (aten ops bound as torch._foreach_*), "
                                                       "what torch.optim's own foreach steps call",
    ("concur.training.step_body", "_foreach_zero_"): "torch's multi-tensor zero, as torch.optim's zero_grad calls it",
    ("concur.fx.trace", "_getframe"): "Python's sys._getframe, not torch's: the first caller outside concur, "
                                        "for a warning's stacklevel",
    ("concur.fx.trace", "_leaf_modules"): "timm's, not torch's: its fx registry where timm has no "
                                            "get_notrace_modules(); absent reads as none",
    ("concur.fx.trace", "_autowrap_functions"): "timm's, not torch's, as _leaf_modules",
    ("concur.inductor.wrapper_program", "_int_mm"): "extern kernel names as inductor's wrapper text spells them: "
                                                    "matched in the text, never read from torch",
    ("concur.inductor.wrapper_program", "_mm_plus_mm"): "as _int_mm",
    ("concur.inductor.wrapper_program", "_scaled_mm"): "as _int_mm",
}
_PRIVATE = re.compile(r"_[A-Za-z]\w*")
_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def _is_private(name: str) -> bool:
    return bool(_PRIVATE.fullmatch(name)) and not name.startswith("__")


def _sources() -> dict[str, ast.Module]:
    paths = {module_name(p): p for p in sorted((ROOT / "concur").rglob("*.py")) if "__pycache__" not in p.parts}
    return {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in paths.items()}


def concur_owned_names(trees: dict[str, ast.Module]) -> set[str]:
    """Private names concur gives its own modules, classes and objects (outside _torch_compat.py).

    Module- and class-level definitions, and attributes a method sets on
    ``self`` or ``cls``; a name defined in _torch_compat.py does not count,
    since there it may be torch's own (a mixin answering nn.Module's protocol).
    """
    owned = set(_NAMEDTUPLE_API)
    for mod, tree in trees.items():
        if mod == COMPAT:
            continue
        bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in bodies:
            for stmt in body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    owned.add(stmt.name)
                elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    owned |= {t.id for t in targets if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                    and n.value.id in ("self", "cls")):
                owned.add(n.attr)
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args
                  and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
                  and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "__dict__"
                  and isinstance(n.func.value.value, ast.Name) and n.func.value.value.id == "self"):
                owned.add(n.args[0].value)  # self.__dict__.setdefault("_memo", ...)
    return {name for name in owned if _is_private(name)}


def private_torch_names(mod: str, tree: ast.Module, owned: set[str]) -> list[tuple[int, str, str]]:
    """(line, name, how) for each private name a module reads that concur does not own.

    What counts: ``import torch._x`` and ``from torch._x import y`` (or
    ``from torch.x import _y``); an attribute ``x._y``; a string ``"_y"``
    (``getattr(m, "_y")``, a tuple of attribute names). Strings inside
    f-strings are parts of text, not names.
    """
    found = []
    in_fstring = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in n.values}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found += [(n.lineno, part, f"import {a.name}") for a in n.names if a.name.split(".")[0] == "torch"
                      for part in a.name.split(".") if _is_private(part)]
        elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "torch":
            found += [(n.lineno, part, f"from {n.module} import") for part in n.module.split(".") if _is_private(part)]
            found += [(n.lineno, a.name, f"from {n.module} import {a.name}") for a in n.names if _is_private(a.name)]
        elif isinstance(n, ast.Attribute) and _is_private(n.attr) and n.attr not in owned:
            found.append((n.lineno, n.attr, f"{ast.unparse(n)}"))
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in in_fstring
              and _is_private(n.value) and n.value not in owned and "concur" not in n.value):
            found.append((n.lineno, n.value, f"the string {n.value!r}"))
    return found


def _allowed(mod: str, name: str) -> bool:
    return any(m == mod and (name == pattern or pattern.endswith("*") and name.startswith(pattern[:-1]))
               for m, pattern in PRIVATE_ALLOWED)


def test_private_torch_names_are_read_only_in_torch_compat():
    """One door to what torch does not promise: every private name is read in _torch_compat.py, or allowed here."""
    trees = _sources()
    owned = concur_owned_names(trees)
    bad = [f"{mod}:{line}: {how}" for mod, tree in sorted(trees.items()) if mod != COMPAT
           for line, name, how in private_torch_names(mod, tree, owned) if not _allowed(mod, name)]
    assert not bad, ("private names outside concur/_torch_compat.py: read them there, behind a version check "
                     "that fails closed (or allow one in PRIVATE_ALLOWED, saying why):\n" + "\n".join(bad))


def foreign_overrides(cls: type, defined: set[str]) -> list[tuple[str, str]]:
    """(name, base) for each private name of ``defined`` that a base class outside concur also defines."""
    found = []
    for name in sorted(filter(_is_private, defined)):
        foreign = [base for base in cls.__mro__[1:] if base is not object
                   and not base.__module__.startswith("concur") and name in vars(base)]
        if foreign:
            found.append((name, f"{foreign[0].__module__}.{foreign[0].__qualname__}"))
    return found


def test_no_concur_class_overrides_a_private_name_of_torch():
    """A class that answers torch's private protocol (nn.Module's ``_save_to_state_dict``) does so in _torch_compat.py."""
    bad = []
    for mod, tree in sorted(_sources().items()):
        if mod in (COMPAT, "concur.__main__"):  # (importing __main__ runs the command)
            continue
        module = importlib.import_module(mod)
        for node in tree.body:
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not inspect.isclass(cls):
                continue
            defined = {s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
            defined |= {t.id for s in node.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                        for t in (s.targets if isinstance(s, ast.Assign) else [s.target]) if isinstance(t, ast.Name)}
            bad += [f"{mod}.{node.name}.{name} overrides {owner}'s" for name, owner in foreign_overrides(cls, defined)]
    assert not bad, "move these overrides of torch's private names into a class of _torch_compat.py:\n" + "\n".join(bad)


def test_the_private_name_check_sees_each_kind_of_read():
    """The checker finds a private import, attribute and attribute-name string, and lets concur's own names be."""
    tree = ast.parse("from torch._inductor import config\nimport torch._dynamo\nfrom torch.optim import _x\n"
                     "m._parameters\ngetattr(opt, '_global_optimizer_pre_hooks')\nself._mine\nf'{a}_part'\n")
    found = {(line, name) for line, name, _ in private_torch_names("concur.x", tree, {"_mine"})}
    assert found == {(1, "_inductor"), (2, "_dynamo"), (3, "_x"), (4, "_parameters"),
                     (5, "_global_optimizer_pre_hooks")}
    assert _allowed("concur.training.captured_optim", "_foreach_add_") and not _allowed("concur.fx.module", "_foreach_add_")

    class Wrapper(torch.nn.Module):
        def _save_to_state_dict(self, *args):
            pass

    assert foreign_overrides(Wrapper, {"_save_to_state_dict", "_mine"}) == [
        ("_save_to_state_dict", "torch.nn.modules.module.Module")]


def test_importing_concur_registers_nothing_and_leaves_dynamo_unimported(tmp_path):
    """torch.compile finds the backend through its entry point; ``import concur`` pays for no torch._dynamo."""
    import subprocess
    import sys

    code = "import sys, concur\nprint(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

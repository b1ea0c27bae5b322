"""The docs keep up with the code: every message concur can emit has a troubleshooting entry,
every public name has an API entry, and the README's install and example work as written.

Messages are read from the source with ``ast``, not by running anything: each
``warnings.warn(...)`` (and every call of a helper whose name says "warn"), each
``raise X(...)`` and each ``...Error(...)`` built to be raised elsewhere, in ``concur/``
and ``schedulers/``. A message's *text* is its literal parts, with ``{}`` where an f-string
formats a value; a name is looked up among the function's own assignments, then the
module-level constants of every source file.

An entry in ``docs/troubleshooting.md`` is a level-3 heading holding one or more key
phrases in backticks, e.g. ``### `capturing the step with` ``. A message is covered when
one of the key phrases occurs in its text (whitespace folded). A key phrase that occurs in
no message is stale: the message was reworded or removed, and the entry must follow.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("concur", "schedulers")
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
API_REFERENCE = ROOT / "docs" / "reference" / "api.md"
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"

_WARN_CALL = re.compile(r"warn", re.IGNORECASE)
_NOT_EMITTING = {"filterwarnings", "simplefilter", "catch_warnings", "resetwarnings"}
_ERROR_CLASS = re.compile(r"(Error|Exception|Warning)$")


@dataclass(frozen=True)
class Message:
    """One warning or error in the source: where it is and its literal text."""

    where: str  # path:line
    kind: str  # "warning" or "error"
    text: str | None  # None: built at run time from something the source does not spell out


def _fold(text: str) -> str:
    return " ".join(text.split())


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


class _Strings:
    """Renders an expression's literal text, resolving names in the function, then the modules."""

    def __init__(self, module_constants: dict[str, ast.expr], functions: dict[str, ast.FunctionDef]):
        self.module_constants, self.functions = module_constants, functions

    def render(self, node: ast.expr | None, local: dict[str, ast.expr], depth: int = 0) -> str | None:
        if node is None or depth > 8:
            return None
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.JoinedStr):  # a formatted name with a known text is spelled out
            return "".join(v.value if isinstance(v, ast.Constant) else
                           self.render(v.value, local, depth + 1) or "{}" if isinstance(v.value, ast.Name) else "{}"
                           for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
            left = self.render(node.left, local, depth + 1)
            if isinstance(node.op, ast.Mod):
                return left
            right = self.render(node.right, local, depth + 1)
            return None if left is None and right is None else (left or "{}") + (right or "{}")
        if isinstance(node, ast.IfExp):
            a, b = self.render(node.body, local, depth + 1), self.render(node.orelse, local, depth + 1)
            return None if a is None and b is None else f"{a or ''} | {b or ''}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
            return self.render(node.func.value, local, depth + 1)
        if isinstance(node, ast.Call) and _callee(node) in self.functions:
            # reason = why_not(...); warn(f"...: {reason}"): the helper's returned text
            func = self.functions[_callee(node)]
            inner = _local_strings(func)
            texts = [self.render(r.value, inner, depth + 1) for r in ast.walk(func)
                     if isinstance(r, ast.Return) and r.value is not None
                     and not (isinstance(r.value, ast.Constant) and r.value.value is None)]
            return next((x for x in texts if x is not None), None)
        if isinstance(node, ast.Name):
            target = local.get(node.id, self.module_constants.get(node.id))
            return self.render(target, local, depth + 1) if target is not None else None
        return None


def _local_strings(func: ast.AST) -> dict[str, ast.expr]:
    """First assignment of each local name in ``func`` (``msg = f"..."; raise X(msg)``)."""
    names: dict[str, ast.expr] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names.setdefault(node.targets[0].id, node.value)
    return names


def _parameters(func: ast.AST) -> set[str]:
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return set()
    a = func.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _functions(trees: dict[Path, ast.Module]) -> dict[str, ast.FunctionDef]:
    return {n.name: n for tree in trees.values() for n in tree.body if isinstance(n, ast.FunctionDef)}


def _module_constants(trees: dict[Path, ast.Module]) -> dict[str, ast.expr]:
    constants: dict[str, ast.expr] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                constants.setdefault(node.targets[0].id, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                constants.setdefault(node.target.id, node.value)
    return constants


class _Finder(ast.NodeVisitor):
    """Collects the emitting calls of one module, each with its innermost enclosing function."""

    def __init__(self, path: str, strings: _Strings):
        self.path, self.strings = path, strings
        self.scopes: list[tuple[dict[str, ast.expr], set[str]]] = [({}, set())]
        self.messages: list[Message] = []

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.scopes.append((_local_strings(node), _parameters(node)))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Raise(self, node: ast.Raise) -> None:
        # raise SomeError(...); `raise helper(...)` (lower case) is skipped: the helper's own
        # SomeError(...) is collected where it is built
        if isinstance(node.exc, ast.Call) and _callee(node.exc)[:1].isupper():
            self._add(node.exc, "error")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _callee(node)
        if _ERROR_CLASS.search(name) and not name.endswith("Warning"):
            self._add(node, "error")  # built here, raised here or by the caller
        elif _WARN_CALL.search(name) and name not in _NOT_EMITTING and node.args and (
                name == "warn" or self._is_text(node.args[0])):
            self._add(node, "warning")  # warn(...), or a helper given a message (not one given a key)
        self.generic_visit(node)

    def _is_text(self, arg: ast.expr) -> bool:
        if isinstance(arg, (ast.Constant, ast.JoinedStr, ast.BinOp)):
            return True
        return isinstance(arg, ast.Name) and self.strings.render(arg, self.scopes[-1][0]) is not None

    def _add(self, call: ast.Call, kind: str) -> None:
        if not call.args:
            return
        local, params = self.scopes[-1]
        first = call.args[0]
        if isinstance(first, ast.Name) and first.id in params and first.id not in local:
            return  # a helper forwarding its caller's message; the caller is collected
        where = f"{self.path}:{call.lineno}"
        if any(m.where == where for m in self.messages):
            return
        text = self.strings.render(first, local)
        self.messages.append(Message(where, kind, None if text is None else _fold(text)))


def source_messages() -> list[Message]:
    """Every warning and error message in concur/ and schedulers/, read with ast."""
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in _sources()}
    strings = _Strings(_module_constants(trees), _functions(trees))
    messages: list[Message] = []
    for path, tree in trees.items():
        finder = _Finder(str(path.relative_to(ROOT)), strings)
        finder.visit(tree)
        messages += finder.messages
    return messages


def troubleshooting_keys() -> dict[str, str]:
    """Key phrase -> the heading it stands in, for every level-3 heading of the troubleshooting page."""
    keys: dict[str, str] = {}
    for line in TROUBLESHOOTING.read_text().splitlines():
        if line.startswith("### "):
            for phrase in re.findall(r"`([^`]+)`", line):
                keys[_fold(phrase)] = line[4:].strip()
    return keys


def _has_words(text: str) -> bool:
    """True if the text says something beyond a prefix such as "concur backend:" and values."""
    return bool(re.search(r"[A-Za-z]{3}", re.sub(r"^concur(?:[. ]\w+){0,2}:", "", text).replace("{}", "")))


def test_every_message_is_read_from_the_source():
    """A message whose text the ast cannot read would escape the coverage test below."""
    messages = source_messages()
    assert len(messages) > 40, "the ast walk found too few messages: has the layout changed?"
    unreadable = [m.where for m in messages if m.text is None or not _has_words(m.text)]
    assert not unreadable, ("these warnings/errors build their message from values only; spell out "
                            f"the words in the call (or in a module-level constant): {unreadable}")


def test_every_message_has_a_troubleshooting_entry():
    keys = troubleshooting_keys()
    missing = [f"{m.where} ({m.kind}): {m.text}" for m in source_messages()
               if m.text is not None and _has_words(m.text) and not any(k in m.text for k in keys)]
    assert not missing, ("add an entry to docs/troubleshooting.md (a '### `key phrase`' heading whose "
                         "phrase occurs in the message) for:\n  " + "\n  ".join(missing))


def source_strings() -> list[str]:
    """Every string literal and f-string of the sources (e.g. a fallback reason passed to a helper)."""
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in _sources()}
    strings = _Strings({}, {})
    return [_fold(strings.render(n, {}) or "") for tree in trees.values() for n in ast.walk(tree)
            if isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))]


def test_no_troubleshooting_entry_is_stale():
    texts = [m.text for m in source_messages() if m.text is not None] + source_strings()
    stale = [f"{k!r} (in '### {h}')" for k, h in troubleshooting_keys().items()
             if not any(k in t for t in texts)]
    assert not stale, "these key phrases occur in no message any more; update the entries: " + ", ".join(stale)


def test_every_public_name_is_in_the_api_reference():
    import concur

    page = API_REFERENCE.read_text()
    missing = [name for name in concur.__all__ if f"::: concur.{name}\n" not in page + "\n"]
    assert not missing, f"add '::: concur.NAME' to docs/reference/api.md for {missing}"


def test_readme_installs_the_torch_that_ci_installs():
    """The README's install is CI's first (the newest torch); CI's later venv of the oldest tested torch is not."""
    ci = CI.read_text()
    install = ci[ci.index('step "install, as the README says"'):]
    install = install[:install.index("\nstep ", 1)]
    pins = re.findall(r'"(torch(?:vision)?==[^"]+)"', install)
    assert pins, ".ci/run pins no torch in its install step: update this test"
    readme = README.read_text()
    assert all(f'"{pin}"' in readme for pin in pins), f"README's install must pin {pins}, as .ci/run does"
    assert 'pip install -e ".[test]"' in readme and "python -m pytest -q" in readme


def test_every_package_a_test_imports_or_skips_is_in_the_test_extra():
    """``pip install -e ".[test]"`` runs every CPU test: none skips for want of a package the extra could give."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^test = \[(.*?)\]", pyproject, re.M | re.S)
    assert extra, "pyproject.toml has no test extra: update this test"
    given = {re.split(r"[<>=!~\[ ]", name, maxsplit=1)[0].lower() for name in re.findall(r'"([^"]+)"', extra[1])}
    wanted = {name.split(".")[0].lower() for path in (ROOT / "tests").glob("*.py")
              for name in re.findall(r'importorskip\(\s*"([^"]+)"', path.read_text())}
    assert wanted, "no test uses pytest.importorskip: update this test"
    assert wanted <= given, f"add {sorted(wanted - given)} to the test extra in pyproject.toml"

def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= 150, "README: at most 150 lines; move detail to docs/"


@pytest.mark.slow
def test_readme_example_runs(tmp_path):
    """The README's Python example runs as written (CPU here, GPU on the device machine)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README has no python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss after 20 steps" in done.stdout
    assert "concur" not in done.stderr, f"the README example makes concur warn:\n{done.stderr[-3000:]}"


def test_the_architecture_page_names_every_module():
    """A newcomer reads docs/architecture.md for what each file does: every module of concur has its row."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `([\w/]+\.py)` \|", page, flags=re.M))
    package = ROOT / "concur"
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") or p.parent == package}
    assert modules - rows == set(), f"modules without a row in docs/architecture.md: {sorted(modules - rows)}"
    assert rows - modules == set(), f"rows for modules that are gone: {sorted(rows - modules)}"


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_every_link_to_a_heading_of_the_docs_finds_it():
    """mkdocs --strict (CI's docs step) refuses a link to an anchor no heading makes; a heading renamed for a new
    message's key phrase moves its anchor. Links within a page and to another page of the docs."""
    assert _slug("### `does not fit in memory` · `capturing the step on`"[4:]) == \
        "does-not-fit-in-memory-capturing-the-step-on"
    def anchors(page: Path) -> set[str]:
        return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}

    broken = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([^)]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if linked.is_file() and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken

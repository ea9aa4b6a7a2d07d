"""The shape of the code, read from its syntax trees: no import cycle (function-level imports included)
in the package or in ``benchmarks/``, no module importing another module's private name, and no
mutable module-level state in the α,β-CROWN plugin beyond the process-wide state its docstring names."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "complete_verifier_ext"
BENCHMARKS = REPO / "benchmarks"

# the plugin's process-wide state (abcrown_plugin/__init__.py says why): module.name
PROCESS_WIDE = {"complete_verifier_ext.abcrown_plugin.locate._ACTIVE"}
MUTABLE_CALLS = {
    "list",
    "dict",
    "set",
    "Counter",
    "defaultdict",
    "OrderedDict",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
    "count",
}


def _modules(root: Path, package: str | None) -> dict[str, Path]:
    """Module name -> file, for a package (dotted names) or a folder of scripts (file stems)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        if package is None:
            if f.parent == root:
                out[f.stem] = f
            continue
        parts = [package, *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _is_package(name: str, f: Path) -> bool:
    return f.name == "__init__.py"


def _imports(name: str, f: Path, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """Every import in ``f`` (at any depth) as (imported module, names taken from it, line), resolved
    against ``known`` (other imports are left out)."""
    tree = ast.parse(f.read_text(), str(f))
    here = name if _is_package(name, f) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for cut in range(len(parts), 0, -1):
                    if ".".join(parts[:cut]) in known:
                        out.append((".".join(parts[:cut]), [], node.lineno))
                        break
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            if mod not in known:
                continue
            names = []
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in known:
                    out.append((sub, [], node.lineno))  # a submodule
                else:
                    names.append(alias.name)
            if names:
                out.append((mod, names, node.lineno))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph(known: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {m for m, _, _ in _imports(name, f, known) if m != name} for name, f in known.items()}


def test_no_import_cycle_in_the_package():
    assert _cycles(_graph(_modules(PACKAGE, "complete_verifier_ext"))) == []


def test_no_import_cycle_in_the_benchmarks():
    assert _cycles(_graph(_modules(BENCHMARKS, None))) == []


def test_no_module_imports_another_modules_private_name():
    """``from x import _name`` or ``x._name`` for a module ``x`` of the package, in the package and the
    benchmarks (dunder names are public)."""
    found = []
    for known in (_modules(PACKAGE, "complete_verifier_ext"), _modules(BENCHMARKS, None)):
        package = _modules(PACKAGE, "complete_verifier_ext")
        everything = {**package, **known}
        for name, f in known.items():
            imported_modules = {}
            for mod, names, line in _imports(name, f, everything):
                for n in names:
                    if n.startswith("_") and not n.startswith("__"):
                        found.append(f"{f.relative_to(REPO)}:{line}: from {mod} import {n}")
            tree = ast.parse(f.read_text())
            for node in ast.walk(tree):  # module aliases bound by imports
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        imported_modules[alias.asname or alias.name] = alias.name
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        imported_modules[alias.asname or alias.name.split(".")[0]] = alias.name
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and node.value.id in imported_modules
                    and any(
                        m.endswith("." + imported_modules[node.value.id]) or m == node.value.id
                        for m in everything
                    )  # fmt: skip
                ):
                    found.append(f"{f.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert found == []


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return called in MUTABLE_CALLS
    return False


def test_the_plugin_has_no_mutable_module_level_state():
    """No module or class of ``abcrown_plugin/`` binds a mutable container, and no function rebinds a
    module global, except the process-wide state named in :data:`PROCESS_WIDE`."""
    found = []
    plugin = {n: f for n, f in _modules(PACKAGE, "complete_verifier_ext").items() if ".abcrown_plugin" in n}
    assert len(plugin) > 20
    for name, f in plugin.items():
        tree = ast.parse(f.read_text())
        scopes = [tree.body] + [c.body for c in tree.body if isinstance(c, ast.ClassDef)]
        for body in scopes:
            for node in body:
                targets, value = [], None
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    targets, value = [node.target], node.value
                if value is not None and _mutable(value):
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                    names = [n for n in names if not (n.startswith("__") and n.endswith("__"))]
                    found += [f"{name}.{n}" for n in names if f"{name}.{n}" not in PROCESS_WIDE]
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found += [f"{name}.{n} (global)" for n in node.names if f"{name}.{n}" not in PROCESS_WIDE]
    assert found == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """The scanners on a planted package: a cycle through a function-level import, a private import, a
    mutable global."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nSTATE = []\n")
    (pkg / "b.py").write_text("def f():\n    from .a import _hidden\n")
    known = _modules(pkg, "p")
    assert _cycles(_graph(known)) == [["p.a", "p.b"]]
    assert ("p.a", ["_hidden"], 2) in _imports("p.b", pkg / "b.py", known)
    assert _mutable(ast.parse("STATE = []").body[0].value)

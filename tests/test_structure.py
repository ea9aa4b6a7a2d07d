"""The shape of the code, read from its syntax trees: no import cycle (function-level imports included)
between modules or between folders, in the package or in ``benchmarks/``; no arrow up the package's
floors; no module importing another module's private name; no mutable module-level state beyond the
named process-wide state; no function over 60 lines (package and tests), no module over 700 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "complete_verifier_ext"
BENCHMARKS = REPO / "benchmarks"

# the package's process-wide state, each with why it is process-wide: module.name -> why
PROCESS_WIDE = {
    "complete_verifier_ext.abcrown_plugin.locate._ACTIVE": "α,β-CROWN's modules are top-level names in "
    "sys.modules: one checkout per process",
    "complete_verifier_ext.clock._IMPORTED_WALL": "the process's start, the origin of every timeout",
    "complete_verifier_ext.clock._IMPORTED_MONO": "the process's start, the origin of every timeout",
    "complete_verifier_ext.parallel.group._solo": "torch.distributed's process group is process-wide",
    "complete_verifier_ext.parallel.group._lockstep": "whether this process's rank may issue collectives",
    "complete_verifier_ext.parallel.memory._library": "torch's optimizer libraries load once per process",
    "complete_verifier_ext.parallel.serve._HOLDERS": "the weights this rank serves to the others",
    "complete_verifier_ext.parallel.serve._counts": "what this rank served (for --summary)",
    "complete_verifier_ext.parallel.serve._KEYS": "request keys, unique within this process",
    "complete_verifier_ext.parallel.serve._serving": "whether this rank serves weight requests now",
    "complete_verifier_ext.parallel.sharded._BUFFERS": "one reusable gather buffer per process and device",
}
# the floors of the package: a module imports only modules of its own floor or below (a folder is one
# unit; anything not named is a top floor: the front doors and the plugin)
FLOORS = {
    "errors": 0, "clock": 0, "deadline": 0, "results": 0, "config": 0, "parallel": 0,
    "spec": 1, "config_load": 1, "config_help": 1, "shell": 1,
    "bounds": 2,
    "model": 3, "attack": 3, "check": 3,
    "bab": 4, "methods": 4, "options": 4, "proofs": 4,
    "verify": 5, "witness": 5, "testing": 5,
}  # fmt: skip
TOP = 9
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 700
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


def _unit(module: str) -> str:
    """A module's folder (its first sub-package), or the module itself at the package's top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, deps in _graph(_modules(PACKAGE, "complete_verifier_ext")).items():
        edges = graph.setdefault(_unit(module), set())
        edges.update(_unit(d) for d in deps if _unit(d) != _unit(module))
    return graph


def test_no_import_cycle_between_folders():
    graph = _folder_graph()
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    assert _cycles(graph) == []


def test_no_arrow_up_the_floors():
    """A module imports only its own floor or lower ones (:data:`FLOORS`)."""
    up = []
    for unit, deps in _folder_graph().items():
        mine = FLOORS.get(unit, TOP)
        up += [f"{unit} -> {d}" for d in sorted(deps) if FLOORS.get(d, TOP) > mine]
    assert not up, "\n".join(up)


def test_no_function_over_60_lines_and_no_module_over_700():
    found = []
    for root in (PACKAGE, REPO / "tests"):
        for f in sorted(root.rglob("*.py")):
            tree = ast.parse(f.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        found.append(f"{f.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
            lines = len(f.read_text().splitlines())
            if root == PACKAGE and lines > MAX_MODULE_LINES:
                found.append(f"{f.relative_to(REPO)}: {lines} lines")
    assert not found, "\n".join(found)


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
    assert not found, "\n".join(found)


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return called in MUTABLE_CALLS
    return False


def test_no_mutable_module_level_state():
    """No module or class of the package binds a mutable container, and no function rebinds a module
    global, except the process-wide state named in :data:`PROCESS_WIDE` (each with why)."""
    found = []
    package = _modules(PACKAGE, "complete_verifier_ext")
    assert len(package) > 60
    for name, f in package.items():
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
    assert not found, "\n".join(found)


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


def test_every_module_is_named_in_the_architecture_doc():
    """``docs/architecture.md`` names every module of the package by its path inside it."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [
        str(rel)
        for f in sorted(PACKAGE.rglob("*.py"))
        if (rel := f.relative_to(PACKAGE)).name != "__init__.py" and f"`{rel}`" not in doc
    ]
    missing += [
        f"{d.name}/" for d in PACKAGE.iterdir() if (d / "__init__.py").exists() and f"{d.name}/" not in doc
    ]
    assert not missing, f"not named in docs/architecture.md: {missing}"


def test_the_readme_is_read_in_five_minutes():
    """The README stays short (200 lines at most); details belong in ``docs/``."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 200

"""Which package may import which (docs/architecture.md): the core stands alone, the engine does not
depend on the simulator, nothing below the front ends imports them, and no two modules import each
other, directly or round a circle (a lazy import inside a function counts too)."""

import ast
import sys
from pathlib import Path

import sloserve

SRC = Path(sloserve.__file__).parent
FRONT_ENDS = {"cli", "server", "bench", "experiments", "plan"}
# package -> the other sloserve packages it may import (None: no rule beyond the front ends')
ALLOWED: dict[str, set[str] | None] = {
    "core": set(),
    "cost": {"core"},
    "metrics": {"core"},
    "workload": {"core"},
    "predict": {"core", "workload"},
    "kv": {"core"},
    "checkpoint": {"core", "cost"},
    "sched": {"core", "cost", "kv", "predict", "workload"},
    "replica": {"core", "metrics", "sched"},
    "router": {"core", "cost"},
    "sim": {"core", "cost", "metrics", "replica", "router", "sched", "kv", "predict", "workload"},
    "engine": {"checkpoint", "core", "cost", "kv", "metrics", "replica", "sched", "workload", "predict"},
    "fleet": {"core", "engine", "router"},
}


def _imports(path: Path) -> set[str]:
    """The sloserve packages a module imports (``sloserve.X...`` -> X), type-checking imports too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("sloserve.") and n.count(".") >= 1}
    return found


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The sloserve modules ``path`` imports anywhere in it: ``from package import submodule`` names the
    submodule, ``from module import name`` the module."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return (found & modules) - {_module(path)}


def _import_circles() -> list[list[str]]:
    """Groups of modules that import one another round a circle (strongly connected components)."""
    paths = {_module(p): p for p in SRC.rglob("*.py")}
    graph = {m: _module_imports(p, set(paths)) for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles():
    assert _import_circles() == []


def test_the_circle_check_finds_a_circle(tmp_path, monkeypatch):
    package = tmp_path / "sloserve"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from sloserve.b import g\n")  # lazy: still a circle
    (package / "b.py").write_text("from sloserve import a\n")
    (package / "c.py").write_text("from sloserve.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", package)
    assert _import_circles() == [["sloserve.a", "sloserve.b"]]


def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_packages_import_only_the_layers_below_them():
    broken = []
    for path in sorted(SRC.rglob("*.py")):
        package = _package(path)
        imported = _imports(path) - {package}
        allowed = ALLOWED.get(package)
        if allowed is not None:
            broken += [f"{path.relative_to(SRC)} imports {name}" for name in sorted(imported - allowed)]
        if package not in FRONT_ENDS and package not in {"__init__", "parallel", "runs", "optimal"}:
            broken += [f"{path.relative_to(SRC)} imports front end {n}" for n in sorted(imported & FRONT_ENDS)]
    assert not broken, "\n".join(broken)


def test_the_check_sees_imports_under_type_checking(tmp_path):
    # A layer broken only for the type checker is still broken (the core once imported the scheduler
    # this way).
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sloserve.sched.cohort import X\n")
    assert _imports(module) == {"sched"}
    assert "core" in _imports(SRC / "cost" / "base.py")  # only under TYPE_CHECKING there

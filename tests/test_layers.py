"""Which package may import which (docs/architecture.md): the core stands alone, the engine does not
depend on the simulator, and nothing below the front ends imports them."""

import ast
from pathlib import Path

import sloserve

SRC = Path(sloserve.__file__).parent
FRONT_ENDS = {"cli", "server", "experiments", "plan"}
# package -> the other sloserve packages it may import (None: no rule beyond the front ends')
ALLOWED: dict[str, set[str] | None] = {
    "core": set(),
    "cost": {"core"},
    "metrics": {"core"},
    "workload": {"core"},
    "predict": {"core"},
    "kv": {"core"},
    "sched": {"core", "cost", "kv", "predict", "workload"},
    "replica": {"core", "metrics", "sched"},
    "sim": {"core", "cost", "metrics", "replica", "sched", "kv", "predict", "workload"},
    "engine": {"core", "cost", "kv", "metrics", "replica", "sched", "workload", "predict"},
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

"""The package is the pipeline: each stage imports only earlier stages, and no module imports
itself round a cycle, lazy imports (inside functions) included. Read from the source with
`ast`, so nothing is imported to check it."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "tpplan"
# the stages in order; a module may import its own stage and the ones before it
STAGES = [
    "_lazy",
    "errors",
    "plan",
    "_runtime",
    "trace",
    "compile",
    "check",
    "infer",
    "apply",
    "checkpoint",
    "diagnose",
    "show",
    "cli",
]
# the package's lazy loader imports every stage by name on first use, by design
EXEMPT = {"tpplan"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The tpplan modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            # the longest known module the target names (a name inside a module counts as it)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("tpplan") and t != name:
                found.add(t)
    return found


def _stage(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return STAGES.index(part)


@cache  # the package does not change during a run: three tests read one graph, parsed once
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {n: _imports(n, p, known) - {"tpplan"} for n, p in modules.items() if n not in EXEMPT}


def test_every_module_belongs_to_a_stage() -> None:
    graph = _graph()
    assert len(graph) > 20
    for name in graph:
        assert name.split(".")[1] in STAGES, f"{name} is in no stage of {STAGES}"


def test_stages_import_only_earlier_stages() -> None:
    wrong = [
        f"{name} (stage {STAGES[_stage(name)]}) imports {other} (stage {STAGES[_stage(other)]})"
        for name, imports in _graph().items()
        for other in imports
        if _stage(other) > _stage(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_round_a_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_plan_stage_imports_no_torch() -> None:
    """Reading, printing and validating a plan file stays instant."""
    for name, path in _modules().items():
        if not name.startswith(("tpplan.plan", "tpplan.errors")):
            continue
        tree = ast.parse(path.read_text())
        roots = {
            a.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for a in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and not node.level
        }
        assert "torch" not in roots, name

"""The core package's modules import one another top-down: no import circle, anywhere.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy
import that closes a circle only hides it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import taskpoint

PACKAGE = Path(taskpoint.__file__).parent


def _module_name(path: Path) -> str:
    return "taskpoint" if path.stem == "__init__" else f"taskpoint.{path.stem}"


def _imports(path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "taskpoint")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "taskpoint":  # from taskpoint import archive, tree
                found.update(
                    f"taskpoint.{a.name}" if f"taskpoint.{a.name}" in modules else "taskpoint"
                    for a in node.names
                )
            elif node.module.split(".")[0] == "taskpoint":
                found.add(node.module)
    return found - {_module_name(path)}


def import_graph() -> dict[str, set[str]]:
    """Each ``taskpoint`` module and the ``taskpoint`` modules it imports."""
    paths = sorted(PACKAGE.glob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) & modules for p in paths}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_sees_the_modules() -> None:
    graph = import_graph()
    assert "taskpoint.checkpoint" in graph["taskpoint"]
    assert "taskpoint.store" in graph["taskpoint.checkpoint"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_modules_import_without_circles() -> None:
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_only_the_package_imports_itself_from_the_top() -> None:
    importers = {m for m, deps in import_graph().items() if "taskpoint" in deps}
    assert importers == set(), f"modules importing the package itself: {sorted(importers)}"

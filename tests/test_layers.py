"""The core package's modules import one another top-down: no import circle, anywhere.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy
import that closes a circle only hides it. Importing a module runs its packages'
``__init__`` too, so an import from another package counts as one of that package as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import taskpoint

PACKAGE = Path(taskpoint.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _paths() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "taskpoint")
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: a relative import; taskpoint imports absolutely"
            if node.module.split(".")[0] == "taskpoint":  # from taskpoint.store import transfer
                found.update(
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                )
    return found


def _packages_of(module: str) -> list[str]:
    """The packages whose ``__init__`` importing ``module`` runs (the root aside)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Each ``taskpoint`` module and the ``taskpoint`` modules importing it runs.

    An import of another package's module counts as one of that package's ``__init__``
    too; within a package, not (Python runs a package's ``__init__`` before its modules).
    """
    paths = _paths()
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps = _imports(path, modules) & modules
        deps |= {p for d in deps for p in _packages_of(d) if not name.startswith(p + ".")}
        graph[name] = deps - {name}
    return graph


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
    assert "taskpoint.checkpoint.checkpoint" in graph["taskpoint"]
    assert "taskpoint.store.store" in graph["taskpoint.checkpoint.checkpoint"]
    assert "taskpoint.store.transfer" in graph["taskpoint.store._location"]  # from X import m
    assert "taskpoint.store" in graph["taskpoint.format.tree"]  # another package's __init__
    assert "taskpoint.store" not in graph["taskpoint.store._location"]  # its own package's


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_modules_import_without_circles() -> None:
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_only_the_package_imports_itself_from_the_top() -> None:
    importers = {m for m, deps in import_graph().items() if "taskpoint" in deps}
    assert importers == set(), f"modules importing the package itself: {sorted(importers)}"

"""The core package's layers import one another top-down: no import circle, anywhere.

``core/src/taskpoint/`` is cut into layers along the data flow (CONTRIBUTING.md, "Layout
and habits"); a module imports only from its own layer and the layers below it::

    faces         taskpoint, taskpoint.cli, taskpoint.integration (the adapters' API)
    inspect       what a checkpoint root holds, drawn for people
    runtime       tasks, attempts, process isolation, ctx(), step boundaries
    checkpoint    Checkpoint: the save and load paths, background uploads, folder mirrors
    distributed   several writers of one checkpoint: coordinators, parts, nodes' disks
    format        what a location holds: manifests, archives, trees, retention, history
    store         one location on any fsspec filesystem (the only fsspec importer)
    base          errors, _types, _env, versions, preemption, progress, _scratch: they import
                  no layer

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy
import that closes a circle only hides it. So does the code of the upload process, a child
started with ``python -c``: its program imports only the standard library, and the module
it runs is checked like any other. Importing a module runs its packages'
``__init__`` too, so an import from another package counts as one of that package as well.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import taskpoint

PACKAGE = Path(taskpoint.__file__).parent

LAYERS: list[tuple[str, ...]] = [
    ("taskpoint.errors", "taskpoint._types", "taskpoint._env", "taskpoint.versions",
     "taskpoint.preemption", "taskpoint.progress", "taskpoint._scratch"),
    ("taskpoint.store",),
    ("taskpoint.format",),
    ("taskpoint.distributed",),
    ("taskpoint.checkpoint",),
    ("taskpoint.runtime",),
    ("taskpoint.inspect",),
    ("taskpoint", "taskpoint.cli", "taskpoint.integration"),
]
"""Bottom to top; an entry holds a module, or a package with every module in it."""

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


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer, or None where it has none."""
    for index, entries in enumerate(LAYERS):
        if any(module == e or (e != "taskpoint" and module.startswith(e + ".")) for e in entries):
            return index
    return None


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


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in import_graph() if layer_of(m) is None)
    assert unplaced == [], f"modules in no layer (add them to LAYERS): {unplaced}"


def test_imports_go_down_the_layers() -> None:
    def layer(module: str) -> int:
        found = layer_of(module)
        assert found is not None, f"{module} is in no layer"
        return found

    upward = sorted(
        f"{module} -> {dep}"
        for module, deps in import_graph().items()
        for dep in deps
        if layer(dep) > layer(module)
    )
    assert upward == [], "imports of a higher layer:\n" + "\n".join(upward)



def _programs(path: Path) -> list[str]:
    """The strings in ``path`` (docstrings aside) that are Python programs importing
    ``taskpoint``: code another interpreter runs (``python -c``), hidden from the graph."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        if id(node) in docstrings or "import" not in node.value:
            continue
        try:
            program = ast.parse(node.value)
        except SyntaxError:
            continue
        if _imports_of_program(program):
            found.append(node.value)
    return found


def _imports_of_program(program: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(program):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "taskpoint")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "taskpoint":
            found.add(node.module or "")
    return found


def test_no_module_hides_imports_in_a_program_string() -> None:
    """A program written in a string (for ``python -c``) imports only the standard
    library: the taskpoint code a child process runs is a module the graph sees."""
    hidden = sorted(str(p.relative_to(PACKAGE)) for p in _paths().values() if _programs(p))
    assert hidden == [], f"modules with a program string importing taskpoint: {hidden}"


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_upload_process_runs_code_of_the_checkpoint_layer_and_below() -> None:
    """The upload process runs :data:`_uploader.CHILD_MODULE`: its bootstrap imports no
    taskpoint module itself, and that module, with everything it imports, sits in the
    checkpoint layer or below. It commits through the saver, built directly, never
    through ``Checkpoint`` (``taskpoint.checkpoint.checkpoint``)."""
    from taskpoint.checkpoint import _uploader

    assert _imports_of_program(ast.parse(_uploader.BOOTSTRAP)) == set()
    graph = import_graph()
    entry = _uploader.CHILD_MODULE
    assert entry in graph, f"the upload process runs {entry}, which is no core module"
    reached = _reached(graph, entry)
    ceiling = layer_of("taskpoint.checkpoint")
    above = sorted(m for m in reached if (layer_of(m) or 0) > (ceiling or 0))
    assert above == [], f"the upload process ({entry}) reaches higher layers: {above}"
    assert "taskpoint.checkpoint.checkpoint" not in reached, sorted(reached)
    assert "taskpoint.checkpoint._save" in reached  # it commits with the saver


MOVED = (
    "taskpoint.coordination", "taskpoint.mirror", "taskpoint.nodes",
    "taskpoint.step_boundary", "taskpoint.torch_coordination", "taskpoint_pytorch._coordination",
)
"""Modules that only re-exported a module's new home, removed: none is left behind."""
_DOTTED = re.compile(r"(?<![\w./-])(taskpoint(?:_[a-z]+)?(?:\.[A-Za-z_]\w*)+)")


def test_no_module_only_re_exports_another() -> None:
    for old in MOVED:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def _resolves(dotted: str) -> bool | None:
    """Whether ``dotted`` names a module or an attribute of one; ``None`` where its
    distribution cannot be imported here (an adapter whose framework is missing)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for name in parts[end:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return None


def test_every_dotted_path_the_sources_name_exists() -> None:
    """A docstring or message naming ``taskpoint.x.y`` (an error's hint, say) names
    something importable, in core and in every adapter whose framework is installed."""
    roots = [PACKAGE.parent, *sorted((PACKAGE.parents[2] / "integrations").glob("*/src"))]
    wrong = sorted(
        f"{path.relative_to(PACKAGE.parents[2])}: {match.group(1)}"
        for root in roots
        for path in root.rglob("*.py")
        for match in _DOTTED.finditer(path.read_text(encoding="utf-8"))
        if _resolves(match.group(1)) is False
    )
    assert wrong == [], "names of nothing:\n" + "\n".join(wrong)

"""The adapters sit on core's public, documented API: ``taskpoint`` and ``taskpoint.integration``.

CONTRIBUTING says the framework adapters (``integrations/*/src/taskpoint_*``) are thin
layers over core's public API. This test reads every adapter source file (``ast``, so
imports inside functions and under ``TYPE_CHECKING`` count) and fails on any use of a
``taskpoint`` module other than those two: ``import taskpoint.x``, ``from taskpoint.x import
y``, ``from taskpoint import <module>``, and attribute chains such as
``taskpoint.runtime.context.supervised()``. Names taken from either face must be listed in
its ``__all__``: what an adapter needs is documented there, or lives in core behind it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import taskpoint
import taskpoint.integration

ROOT = Path(__file__).resolve().parents[1]
ADAPTER_SOURCES = sorted(ROOT.glob("integrations/*/src/taskpoint_*/**/*.py"))
FACES = {
    "taskpoint": set(taskpoint.__all__),
    "taskpoint.integration": set(taskpoint.integration.__all__),
}


def _violations(source: str) -> list[str]:
    """Each use in ``source`` of a ``taskpoint`` module or name beyond the two faces."""
    tree = ast.parse(source)
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> the face module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "taskpoint":
                    continue
                if alias.name not in FACES:
                    found.append(f"line {node.lineno}: import {alias.name}")
                elif alias.asname or "." not in alias.name:
                    bound[alias.asname or alias.name] = alias.name
                else:  # import taskpoint.integration binds ``taskpoint``
                    bound["taskpoint"] = "taskpoint"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "taskpoint":
                continue
            if node.module not in FACES:
                found.append(f"line {node.lineno}: from {node.module} import ...")
                continue
            for alias in node.names:
                if alias.name not in FACES[node.module]:
                    found.append(
                        f"line {node.lineno}: from {node.module} import {alias.name} "
                        f"(not in {node.module}.__all__)"
                    )
    for node in ast.walk(tree):  # taskpoint.<name> in code: <name> must be public
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            face = bound[node.value.id]
            dotted = f"{face}.{node.attr}"
            if dotted not in FACES and node.attr not in FACES[face] and node.attr != "__version__":
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_there_are_adapter_sources() -> None:
    names = {p.relative_to(ROOT).parts[1] for p in ADAPTER_SOURCES}
    assert {"hf", "lightning", "pytorch", "sklearn", "unsloth"} <= names


@pytest.mark.parametrize(
    "path", ADAPTER_SOURCES, ids=[str(p.relative_to(ROOT / "integrations")) for p in ADAPTER_SOURCES]
)
def test_adapter_imports_only_the_public_faces(path: Path) -> None:
    found = _violations(path.read_text(encoding="utf-8"))
    assert not found, (
        f"{path.relative_to(ROOT)} reaches past core's public API (use taskpoint or "
        f"taskpoint.integration): " + "; ".join(found)
    )


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("from taskpoint.checkpoint.mirror import unshare", True),
        ("from taskpoint import preemption", True),
        ("from taskpoint import distributed as d", True),
        ("import taskpoint.runtime.context", True),
        ("import taskpoint\ntaskpoint.runtime.context.supervised()", True),
        ("def f():\n    from taskpoint.format.manifest import Manifest", True),
        ("from taskpoint.integration import not_a_name", True),
        ("import taskpoint\ntaskpoint.ctx()", False),
        ("from taskpoint import Checkpoint, CheckpointLike", False),
        ("from taskpoint.integration import FolderMirror", False),
        ("import taskpoint.integration as tpi\ntpi.FolderMirror", False),
        ("from taskpoint_hf import resume", False),
    ],
)
def test_the_check_tells_public_from_internal(source: str, bad: bool) -> None:
    assert bool(_violations(source)) is bad, source

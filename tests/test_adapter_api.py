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
import subprocess
import sys
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


# The logic the adapters held and core now holds behind taskpoint.integration.


def test_as_of_now_runs_a_later_job_with_the_step_and_the_preemption_answer_of_its_call() -> None:
    import threading

    from taskpoint import preemption, progress
    from taskpoint.progress import as_of_now

    seen: list[tuple[int | None, bool]] = []
    try:
        progress.report_step(3)
        job = as_of_now(lambda: seen.append((progress.current_step(), preemption.requested())))
        progress.report_step(7)  # training moved on, and a signal came, before the job ran
        preemption.relay(60.0)
        thread = threading.Thread(target=job)
        thread.start()
        thread.join()
        assert seen == [(3, False)]
        assert (progress.current_step(), preemption.requested()) == (7, True)  # unpinned here
    finally:
        preemption.reset()
        progress.reset()


def test_stores_by_content_tells_a_format_2_checkpoint_from_the_rest() -> None:
    from taskpoint.integration import stores_by_content

    assert stores_by_content(taskpoint.Checkpoint("memory://api/tree")) is True
    assert stores_by_content(taskpoint.Checkpoint("memory://api/tar", store_format=1)) is False
    assert stores_by_content(object()) is False  # another system's checkpoint object


def test_saves_on_preemption_is_the_rule_with_this_process_restarted_or_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from taskpoint.integration import saves_on_preemption
    from taskpoint.runtime.context import supervised

    monkeypatch.delenv("TASKPOINT_SAVE_ON_PREEMPTION", raising=False)
    assert saves_on_preemption(None) is supervised()
    assert saves_on_preemption(None, restarted=True) is True
    assert saves_on_preemption(False, restarted=True) is False
    monkeypatch.setenv("TASKPOINT_SAVE_ON_PREEMPTION", "0")
    assert saves_on_preemption(None, restarted=True) is False
    monkeypatch.setenv("TASKPOINT_SAVE_ON_PREEMPTION", "maybe")
    with pytest.raises(ValueError, match="TASKPOINT_SAVE_ON_PREEMPTION must be"):
        saves_on_preemption(None)


@pytest.mark.parametrize(
    ("module", "distribution", "found", "message"),
    [
        ("taskpoint_pytorch", "torch", "2.3.1",
         "taskpoint-pytorch requested torch>=2.4,<3 but found torch 2.3.1"),
        ("taskpoint_hf", "transformers", "4.45.2",
         "taskpoint-hf requested transformers>=4.46,<6 but found transformers 4.45.2"),
        ("taskpoint_sklearn", "scikit-learn", "1.3.2",
         "taskpoint-sklearn requested scikit-learn>=1.4,<2.0 but found scikit-learn 1.3.2"),
        ("taskpoint_lightning", "lightning", "2.3.3",
         "taskpoint-lightning requested lightning>=2.4,<3 but found lightning 2.3.3"),
        ("taskpoint_lightning.pytorch_lightning", "pytorch-lightning", "1.9.5",
         "taskpoint-lightning requested pytorch-lightning>=2.4,<3 but found "
         "pytorch-lightning 1.9.5"),
    ],
)
def test_an_adapter_refuses_to_import_beside_an_unsupported_framework(
    module: str, distribution: str, found: str, message: str
) -> None:
    """Each adapter checks its framework's release as it is imported (Unsloth's, in its own
    environment, is checked by its own tests), before it imports the framework."""
    code = (
        "from importlib import metadata\n"
        "real = metadata.version\n"
        f"metadata.version = lambda name: {found!r} if name == {distribution!r} else real(name)\n"
        f"import {module}\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert f"ImportError: {message}; install a supported version" in run.stderr

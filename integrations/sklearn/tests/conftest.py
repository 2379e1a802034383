"""Fixtures for the taskpoint_sklearn tests."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent


def _load_cases() -> ModuleType:
    name = "taskpoint_sklearn_test_cases"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "cases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def cases() -> ModuleType:
    """``cases.py``: the estimators under test and exact comparison helpers."""
    return _load_cases()


@pytest.fixture
def evil_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """An importable module whose ``Evil`` class writes ``MARKER`` when skops builds one
    (or when one is unpickled), and whose ``Note`` class is harmless but not trusted.

    Stands for code an attacker wants run: if ``MARKER`` exists, code from a checkpoint ran.
    """
    name = f"tp_evil_{tmp_path.name.replace('-', '_')}"
    marker = tmp_path / "code-ran"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path

            MARKER = Path({str(marker)!r})


            class Evil:
                def __setstate__(self, state):
                    MARKER.write_text("code from the checkpoint ran")
                    self.__dict__.update(state)

                def __reduce__(self):
                    return (MARKER.write_text, ("code from the checkpoint ran",))


            class Note:
                def __init__(self, text):
                    self.text = text
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    yield module
    sys.modules.pop(name, None)

"""The public names and the Unsloth version check."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("unsloth", reason="Unsloth is not installed: run these tests with "
                    "`UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth "
                    "pytest integrations/unsloth/tests`")

import taskpoint
import taskpoint_unsloth
from taskpoint_unsloth import callback, lora, resume


def _check(found: str) -> str:
    wanted = f"unsloth{taskpoint_unsloth.SUPPORTED_UNSLOTH}"
    return taskpoint.require_version(wanted, adapter="taskpoint-unsloth", found=found)


def test_all_lists_every_public_name() -> None:
    expected = {*callback.__all__, *lora.__all__, *resume.__all__, "SUPPORTED_UNSLOTH",
                "__version__"}
    assert set(taskpoint_unsloth.__all__) == expected
    for name in taskpoint_unsloth.__all__:
        assert getattr(taskpoint_unsloth, name) is not None


@pytest.mark.parametrize("version", ["2026.10.0", "2026.10.9", "2026.11.1", "2027.1.0"])
def test_supported_unsloth_versions_pass(version: str) -> None:
    assert _check(version) == version


@pytest.mark.parametrize("version", ["2026.9.3", "2025.12.1", "nightly"])
def test_unsupported_unsloth_version_names_both(version: str) -> None:
    with pytest.raises(ImportError) as info:
        _check(version)
    assert f"requested unsloth>=2026.10 but found unsloth {version}" in str(info.value)


def test_importing_beside_an_unsupported_unsloth_fails_naming_the_range() -> None:
    code = (
        "from importlib import metadata\n"
        "real = metadata.version\n"
        "metadata.version = lambda name: '2026.9.3' if name == 'unsloth' else real(name)\n"
        "import taskpoint_unsloth\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "ImportError: taskpoint-unsloth requested unsloth>=2026.10 but found unsloth 2026.9.3" in run.stderr

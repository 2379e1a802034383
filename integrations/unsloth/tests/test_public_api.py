"""The public names and the Unsloth version check."""

from __future__ import annotations

import pytest

pytest.importorskip("unsloth", reason="Unsloth is not installed: run these tests with "
                    "`UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth "
                    "pytest integrations/unsloth/tests`")

import taskpoint_unsloth
from taskpoint_unsloth import _compat, callback, lora, resume


def test_all_lists_every_public_name() -> None:
    expected = {*callback.__all__, *lora.__all__, *resume.__all__, "SUPPORTED_UNSLOTH",
                "__version__"}
    assert set(taskpoint_unsloth.__all__) == expected
    for name in taskpoint_unsloth.__all__:
        assert getattr(taskpoint_unsloth, name) is not None


@pytest.mark.parametrize("version", ["2026.10.0", "2026.10.9", "2026.11.1", "2027.1.0"])
def test_supported_unsloth_versions_pass(version: str) -> None:
    assert _compat.check_unsloth_version(version) == version


@pytest.mark.parametrize("version", ["2026.9.3", "2025.12.1", "nightly"])
def test_unsupported_unsloth_version_names_both(version: str) -> None:
    with pytest.raises(ImportError) as info:
        _compat.check_unsloth_version(version)
    assert f"requested unsloth>=2026.10 but found unsloth {version}" in str(info.value)


def test_installed_unsloth_is_supported() -> None:
    import unsloth

    assert _compat.check_unsloth_version() == unsloth.__version__


def test_mismatch_error_is_a_taskpoint_error() -> None:
    import taskpoint

    assert issubclass(taskpoint_unsloth.LoraConfigMismatchError, taskpoint.CheckpointError)
    assert issubclass(taskpoint_unsloth.LoraConfigMismatchError, ValueError)


def test_taskpoint_unsloth_extra_pulls_this_adapter() -> None:
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    extras = [Requirement(r) for r in requires("taskpoint") or []]
    unsloth = [r for r in extras if r.marker is not None and r.marker.evaluate({"extra": "unsloth"})
               and not r.marker.evaluate({"extra": ""})]
    assert [r.name for r in unsloth] == ["taskpoint-unsloth"]

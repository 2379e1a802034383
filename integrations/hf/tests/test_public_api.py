"""The public names and the transformers version check."""

from __future__ import annotations

import pytest
import taskpoint
import taskpoint_hf
from taskpoint_hf import callback, resume


def _check(found: str) -> str:
    wanted = f"transformers{taskpoint_hf.SUPPORTED_TRANSFORMERS}"
    return taskpoint.require_version(wanted, adapter="taskpoint-hf", found=found)


def test_all_lists_every_public_name() -> None:
    expected = {*callback.__all__, *resume.__all__, "SUPPORTED_TRANSFORMERS", "__version__"}
    assert set(taskpoint_hf.__all__) == expected
    for name in taskpoint_hf.__all__:
        assert getattr(taskpoint_hf, name) is not None


@pytest.mark.parametrize("version", ["4.46.0", "4.57.1", "5.0.0.dev0", "5.24.0"])
def test_supported_transformers_versions_pass(version: str) -> None:
    assert _check(version) == version


@pytest.mark.parametrize("version", ["4.45.2", "3.5.0", "6.0.0", "nightly"])
def test_unsupported_transformers_version_names_both(version: str) -> None:
    with pytest.raises(ImportError) as info:
        _check(version)
    assert f"requested transformers>=4.46,<6 but found transformers {version}" in str(info.value)

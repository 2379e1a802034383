"""taskpoint.require_version: the adapters' import-time framework check."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import taskpoint


@pytest.mark.parametrize("found", ["2.4.0", "2.15.0+cu132", "2.6.0.dev20250101", "2.99"])
def test_versions_in_range_pass_and_are_returned(found: str) -> None:
    assert taskpoint.require_version("torch>=2.4,<3", adapter="taskpoint-pytorch", found=found) == found


@pytest.mark.parametrize("found", ["2.3.1", "3.0.0", "1.13.1+cpu", "nightly", ""])
def test_versions_out_of_range_name_request_found_and_fix(found: str) -> None:
    with pytest.raises(ImportError) as info:
        taskpoint.require_version("torch>=2.4,<3", adapter="taskpoint-pytorch", found=found)
    assert str(info.value) == (
        f"taskpoint-pytorch requested torch>=2.4,<3 but found torch {found}; install a "
        "supported version with: pip install 'torch>=2.4,<3'"
    )


def test_the_installed_version_is_read_when_none_is_given() -> None:
    assert taskpoint.require_version("xxhash>=3", adapter="taskpoint") == version("xxhash")


def test_a_missing_distribution_says_how_to_install_it() -> None:
    with pytest.raises(ImportError, match=r"^taskpoint-x requested no-such-dist-tp>=1 but found "
                       r"none installed; install it with: pip install 'no-such-dist-tp>=1'$"):
        taskpoint.require_version("no-such-dist-tp>=1", adapter="taskpoint-x")


def test_a_malformed_requirement_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a valid requirement string: 'torch >>> 2'"):
        taskpoint.require_version("torch >>> 2", adapter="taskpoint-pytorch")

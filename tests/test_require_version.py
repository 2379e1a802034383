"""taskpoint.require_version: the adapters' import-time framework check."""

from __future__ import annotations

import subprocess
import sys
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


@pytest.mark.parametrize("found", ["2.4.0", "2.4", "2.15.0+cu132", "2.99", "3.0.0", "2.3.9", "10.1"])
@pytest.mark.parametrize("wanted", ["torch>=2.4,<3", "torch > 2.4, != 2.99", "torch==2.4", "torch<=3"])
def test_plain_releases_are_judged_as_packaging_judges_them(found: str, wanted: str) -> None:
    from packaging.requirements import Requirement
    from packaging.version import Version

    expected = Requirement(wanted).specifier.contains(Version(found), prereleases=True)
    try:
        taskpoint.require_version(wanted, adapter="taskpoint-pytorch", found=found)
    except ImportError:
        assert not expected
    else:
        assert expected


def test_checking_the_adapters_requirements_imports_no_packaging() -> None:
    """The check runs at every adapter import, which a restarted job pays for on each
    restart; the ``packaging`` parser took about a tenth of a second of it."""
    code = (
        "import sys, taskpoint\n"
        "taskpoint.require_version('torch>=2.4,<3', adapter='taskpoint-pytorch', found='2.5.1+cu124')\n"
        "assert 'packaging' not in sys.modules, sorted(m for m in sys.modules if 'packaging' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

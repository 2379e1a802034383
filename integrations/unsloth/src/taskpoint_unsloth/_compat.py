"""The Unsloth versions taskpoint-unsloth supports, checked once at import."""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SUPPORTED_UNSLOTH", "check_unsloth_version"]

SUPPORTED_UNSLOTH = ">=2026.10"
"""The Unsloth releases this adapter supports (PEP 440 specifier): the first with CPU training."""

_LOWEST = (2026, 10)
_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)")


def check_unsloth_version(found: str | None = None) -> str:
    """Check that Unsloth is within :data:`SUPPORTED_UNSLOTH`.

    Args:
        found: the version to check; the installed distribution's by default.

    Returns:
        The version checked.

    Raises:
        ImportError: Unsloth is missing, or its version is outside the supported range.
    """
    if found is None:
        try:
            found = metadata.version("unsloth")
        except metadata.PackageNotFoundError as exc:
            raise ImportError(
                f"taskpoint-unsloth requested unsloth{SUPPORTED_UNSLOTH} but found none "
                'installed: pip install "taskpoint-unsloth"'
            ) from exc
    match = _RELEASE.match(found)
    release = (int(match[1]), int(match[2])) if match else None
    if release is None or release < _LOWEST:
        raise ImportError(
            f"taskpoint-unsloth requested unsloth{SUPPORTED_UNSLOTH} but found unsloth "
            f'{found}: pip install "unsloth{SUPPORTED_UNSLOTH}"'
        )
    return found

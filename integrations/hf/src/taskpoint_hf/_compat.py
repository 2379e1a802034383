"""The transformers versions taskpoint-hf supports, checked once at import."""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SUPPORTED_TRANSFORMERS", "check_transformers_version"]

SUPPORTED_TRANSFORMERS = ">=4.46,<6"
"""The transformers releases this adapter supports (PEP 440 specifier)."""

_LOWEST = (4, 46)
_BELOW = (6, 0)
_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)")


def check_transformers_version(found: str | None = None) -> str:
    """Check that transformers is within :data:`SUPPORTED_TRANSFORMERS`.

    Args:
        found: the version to check; the installed distribution's by default.

    Returns:
        The version checked.

    Raises:
        ImportError: transformers is missing, or its version is outside the supported range.
    """
    if found is None:
        try:
            found = metadata.version("transformers")
        except metadata.PackageNotFoundError as exc:
            raise ImportError(
                f"taskpoint-hf requested transformers{SUPPORTED_TRANSFORMERS} but found none "
                'installed: pip install "taskpoint[hf]"'
            ) from exc
    match = _RELEASE.match(found)
    release = (int(match[1]), int(match[2])) if match else None
    if release is None or not _LOWEST <= release < _BELOW:
        raise ImportError(
            f"taskpoint-hf requested transformers{SUPPORTED_TRANSFORMERS} but found "
            f'transformers {found}: pip install "transformers{SUPPORTED_TRANSFORMERS}"'
        )
    return found

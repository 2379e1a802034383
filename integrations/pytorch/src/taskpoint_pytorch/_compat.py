"""The PyTorch versions this adapter supports, checked once at import."""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SUPPORTED_TORCH", "check_torch_version"]

SUPPORTED_TORCH = "torch>=2.4,<3"
"""The supported range, as a requirement string (also the install hint)."""

_MINIMUM = (2, 4)
_BELOW_MAJOR = 3


def _parse(version: str) -> tuple[int, int] | None:
    match = re.match(r"^\s*(\d+)\.(\d+)", version)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def check_torch_version(found: str | None = None) -> str:
    """Raise unless the installed (or given) torch version is in :data:`SUPPORTED_TORCH`.

    Args:
        found: the version to check; the installed ``torch`` distribution's by default.

    Returns:
        The version checked.

    Raises:
        ImportError: torch is missing, or its version is outside the supported range.
    """
    if found is None:
        try:
            found = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"taskpoint-pytorch requested {SUPPORTED_TORCH} but found no torch "
                f"installation; install it with: pip install '{SUPPORTED_TORCH}'"
            ) from None
    parsed = _parse(found)
    if parsed is None or parsed < _MINIMUM or parsed[0] >= _BELOW_MAJOR:
        raise ImportError(
            f"taskpoint-pytorch requested {SUPPORTED_TORCH} but found torch {found}; "
            f"install a supported version with: pip install '{SUPPORTED_TORCH}'"
        )
    return found

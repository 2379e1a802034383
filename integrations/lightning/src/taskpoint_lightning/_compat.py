"""The Lightning versions this adapter supports, checked once at import."""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SUPPORTED_LIGHTNING", "check_lightning_version"]

SUPPORTED_LIGHTNING = "lightning>=2.4,<3"
"""The supported range, as a requirement string (also the install hint)."""

_MINIMUM = (2, 4)
_BELOW_MAJOR = 3


def _parse(version: str) -> tuple[int, int] | None:
    match = re.match(r"^\s*(\d+)\.(\d+)", version)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def check_lightning_version(found: str | None = None, distribution: str = "lightning") -> str:
    """Raise unless the installed (or given) Lightning version is in the supported range.

    Args:
        found: the version to check; the installed distribution's by default.
        distribution: ``"lightning"``, or ``"pytorch-lightning"`` for the standalone package
            (same version numbers, same range).

    Returns:
        The version checked.

    Raises:
        ImportError: the distribution is missing, or its version is outside the range.
    """
    wanted = SUPPORTED_LIGHTNING.replace("lightning", distribution, 1)
    if found is None:
        try:
            found = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"taskpoint-lightning requested {wanted} but found no {distribution} "
                f"installation; install it with: pip install '{wanted}'"
            ) from None
    parsed = _parse(found)
    if parsed is None or parsed < _MINIMUM or parsed[0] >= _BELOW_MAJOR:
        raise ImportError(
            f"taskpoint-lightning requested {wanted} but found {distribution} {found}; "
            f"install a supported version with: pip install '{wanted}'"
        )
    return found

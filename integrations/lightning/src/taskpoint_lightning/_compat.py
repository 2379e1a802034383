"""The Lightning versions this adapter supports, checked once at import."""

from __future__ import annotations

from taskpoint import require_version

__all__ = ["SUPPORTED_LIGHTNING", "check_lightning_version"]

SUPPORTED_LIGHTNING = "lightning>=2.4,<3"
"""The supported range, as a requirement string (also the install hint)."""


def check_lightning_version(found: str | None = None, distribution: str = "lightning") -> str:
    """Raise ``ImportError`` unless the installed (or given) Lightning is in the supported range.

    Args:
        found: the version to check; the installed distribution's by default.
        distribution: ``"lightning"``, or ``"pytorch-lightning"`` for the standalone package
            (same version numbers, same range).

    Returns the version checked; see :func:`taskpoint.require_version`.
    """
    wanted = SUPPORTED_LIGHTNING.replace("lightning", distribution, 1)
    return require_version(wanted, adapter="taskpoint-lightning", found=found)

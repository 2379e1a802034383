"""The Unsloth versions taskpoint-unsloth supports, checked once at import."""

from __future__ import annotations

from taskpoint import require_version

__all__ = ["SUPPORTED_UNSLOTH", "check_unsloth_version"]

SUPPORTED_UNSLOTH = ">=2026.10"
"""The Unsloth releases this adapter supports (PEP 440 specifier): the first with CPU training."""


def check_unsloth_version(found: str | None = None) -> str:
    """Raise ``ImportError`` unless Unsloth is within :data:`SUPPORTED_UNSLOTH`.

    Returns the version checked; see :func:`taskpoint.require_version`.
    """
    return require_version(f"unsloth{SUPPORTED_UNSLOTH}", adapter="taskpoint-unsloth", found=found)

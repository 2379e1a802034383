"""The transformers versions taskpoint-hf supports, checked once at import."""

from __future__ import annotations

from taskpoint import require_version

__all__ = ["SUPPORTED_TRANSFORMERS", "check_transformers_version"]

SUPPORTED_TRANSFORMERS = ">=4.46,<6"
"""The transformers releases this adapter supports (PEP 440 specifier)."""


def check_transformers_version(found: str | None = None) -> str:
    """Raise ``ImportError`` unless transformers is within :data:`SUPPORTED_TRANSFORMERS`.

    Returns the version checked; see :func:`taskpoint.require_version`.
    """
    return require_version(
        f"transformers{SUPPORTED_TRANSFORMERS}", adapter="taskpoint-hf", found=found
    )

"""The framework versions this adapter supports, checked once at import."""

from __future__ import annotations

from taskpoint import require_version

__all__ = ["SUPPORTED", "check_versions"]

SUPPORTED: dict[str, str] = {
    "scikit-learn": ">=1.4,<2.0",
    "skops": ">=0.10,<1.0",
    "numpy": ">=1.26,<3.0",
}
"""Distribution name -> the supported range (PEP 440 specifier)."""


def check_versions() -> None:
    """Raise ``ImportError`` unless every framework package is in its supported range.

    See :func:`taskpoint.require_version` for the message.
    """
    for dist, spec in SUPPORTED.items():
        require_version(f"{dist}{spec}", adapter="taskpoint-sklearn")

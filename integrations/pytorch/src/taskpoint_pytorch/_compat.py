"""The PyTorch versions this adapter supports, checked once at import."""

from __future__ import annotations

from taskpoint import require_version

__all__ = ["SUPPORTED_TORCH", "check_torch_version"]

SUPPORTED_TORCH = "torch>=2.4,<3"
"""The supported range, as a requirement string (also the install hint)."""


def check_torch_version(found: str | None = None) -> str:
    """Raise ``ImportError`` unless the installed (or given) torch is in :data:`SUPPORTED_TORCH`.

    Returns the version checked; see :func:`taskpoint.require_version`.
    """
    return require_version(SUPPORTED_TORCH, adapter="taskpoint-pytorch", found=found)

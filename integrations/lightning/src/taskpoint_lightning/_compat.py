"""The Lightning versions this adapter supports, checked once at import."""

from __future__ import annotations

import sys

from taskpoint import require_version

__all__ = ["SUPPORTED_LIGHTNING", "check_lightning_version", "loaded_classes"]

SUPPORTED_LIGHTNING = "lightning>=2.4,<3"
"""The supported range, as a requirement string (also the install hint)."""


def check_lightning_version(found: str | None = None, distribution: str = "lightning") -> str:
    """Raise ``ImportError`` unless the installed (or ``found``) version of ``distribution``
    (``"lightning"``, or the standalone ``"pytorch-lightning"``: same numbers, same range)
    is supported; the version checked (see :func:`taskpoint.require_version`)."""
    wanted = SUPPORTED_LIGHTNING.replace("lightning", distribution, 1)
    return require_version(wanted, adapter="taskpoint-lightning", found=found)


def loaded_classes(module: str, name: str) -> tuple[type, ...]:
    """The class ``name`` of ``lightning.pytorch.<module>`` and ``pytorch_lightning.<module>``,
    from each package already imported."""
    found = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        cls = getattr(sys.modules.get(f"{package}.{module}"), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)

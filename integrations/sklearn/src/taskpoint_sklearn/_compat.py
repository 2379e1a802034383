"""The framework versions this adapter supports, checked once at import."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

__all__ = ["SUPPORTED", "check_versions"]

SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "scikit-learn": ((1, 4), (2, 0)),
    "skops": ((0, 10), (1, 0)),
    "numpy": ((1, 26), (3, 0)),
}
"""Distribution name -> (lowest supported version, first unsupported version)."""


def _parse(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split(".")[:3]:
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def _spec(low: tuple[int, ...], high: tuple[int, ...]) -> str:
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


def check_versions() -> None:
    """Raise ``ImportError`` unless every framework package is in its supported range.

    Raises:
        ImportError: a package is missing or outside :data:`SUPPORTED`, naming the
            requested range and the version found.
    """
    for dist, (low, high) in SUPPORTED.items():
        try:
            found = version(dist)
        except PackageNotFoundError:
            raise ImportError(
                f"taskpoint_sklearn requested {dist}{_spec(low, high)} but found none "
                f'installed; install it with: pip install "taskpoint[sklearn]"'
            ) from None
        if not low <= _parse(found) < high:
            raise ImportError(
                f"taskpoint_sklearn requested {dist}{_spec(low, high)} but found {dist} "
                f"{found}; install a supported version"
            )

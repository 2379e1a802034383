"""Version checks for the frameworks an adapter wraps, run once when the adapter is imported.

Adapters declare the framework releases they support as requirement strings
(``"torch>=2.4,<3"``) and call :func:`require_version` at import, so that an unsupported
install fails at once with a message naming what was asked for, what was found and how to
fix it, instead of failing somewhere inside a training run.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from importlib import metadata

__all__ = ["require_version"]

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|<|>)\s*(\d+(?:\.\d+)*)\s*")
_SIMPLE = re.compile(rf"\s*({_NAME})((?:{_CLAUSE.pattern},)*{_CLAUSE.pattern})")
_RELEASE = re.compile(r"(\d+(?:\.\d+)*)(?:\+[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*)?")
_COMPARE: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt,
    "==": operator.eq, "!=": operator.ne,
}


def _release(text: str) -> tuple[int, ...]:
    """A release number as a tuple without trailing zeros (``2.4.0`` is ``2.4``)."""
    numbers = [int(part) for part in text.split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def _simple(requirement: str) -> tuple[str, list[tuple[str, tuple[int, ...]]]] | None:
    """``requirement``'s name and its clauses when it is a name and comparisons with plain
    release numbers (``torch>=2.4,<3``), else ``None``."""
    match = _SIMPLE.fullmatch(requirement)
    if match is None:
        return None
    clauses = [(op, _release(number)) for op, number in _CLAUSE.findall(match.group(2))]
    return match.group(1), clauses


def require_version(requirement: str, *, adapter: str, found: str | None = None) -> str:
    """Check that the installed (or given) version of a distribution meets ``requirement``.

    Pre-releases and local builds count by their release number (``2.6.0.dev1``,
    ``2.5.1+cu124``).

    Args:
        requirement: a PEP 508 requirement naming the distribution and its supported range,
            such as ``"torch>=2.4,<3"``.
        adapter: the distribution asking (``"taskpoint-pytorch"``), named in the message.
        found: the version to check; the installed distribution's by default.

    Returns:
        The version checked.

    Raises:
        ImportError: the distribution is not installed, its version is not a PEP 440
            version, or it is outside the range. The message names the requirement, the
            version found and the ``pip install`` line that fixes it.
        ValueError: ``requirement`` is not a valid requirement string.
    """
    simple = _simple(requirement)
    if simple is not None:  # the adapters' form, checked without importing packaging
        name = simple[0]
    else:
        from packaging.requirements import InvalidRequirement, Requirement

        try:
            name = Requirement(requirement).name
        except InvalidRequirement as exc:
            raise ValueError(f"not a valid requirement string: {requirement!r} ({exc})") from exc
    if found is None:
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"{adapter} requested {requirement} but found none installed; install it "
                f"with: pip install '{requirement}'"
            ) from None
    release = _RELEASE.fullmatch(found)
    if simple is not None and release is not None:
        # a release (and local label) against release numbers: PEP 440 compares the
        # release numbers, padded with zeros; packaging is needed for the rest
        have = _release(release.group(1))
        ok = all(_COMPARE[op](have, number) for op, number in simple[1])
    else:
        from packaging.requirements import Requirement
        from packaging.version import InvalidVersion, Version

        try:
            ok = Requirement(requirement).specifier.contains(Version(found), prereleases=True)
        except InvalidVersion:
            ok = False
    if not ok:
        raise ImportError(
            f"{adapter} requested {requirement} but found {name} {found}; install a "
            f"supported version with: pip install '{requirement}'"
        )
    return found

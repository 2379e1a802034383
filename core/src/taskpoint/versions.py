"""Version checks for the frameworks an adapter wraps, run once when the adapter is imported.

Adapters declare the framework releases they support as requirement strings
(``"torch>=2.4,<3"``) and call :func:`require_version` at import, so that an unsupported
install fails at once with a message naming what was asked for, what was found and how to
fix it, instead of failing somewhere inside a training run.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

__all__ = ["require_version"]


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
    try:
        wanted = Requirement(requirement)
    except InvalidRequirement as exc:
        raise ValueError(f"not a valid requirement string: {requirement!r} ({exc})") from exc
    if found is None:
        try:
            found = metadata.version(wanted.name)
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"{adapter} requested {requirement} but found none installed; install it "
                f"with: pip install '{requirement}'"
            ) from None
    try:
        ok = wanted.specifier.contains(Version(found), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ImportError(
            f"{adapter} requested {requirement} but found {wanted.name} {found}; install a "
            f"supported version with: pip install '{requirement}'"
        )
    return found

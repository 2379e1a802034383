"""The rule for names that become part of a store path: task, run and environment names.

Kept apart so that :mod:`taskpoint.runtime.context`, :mod:`taskpoint.runtime.tasks` and
:mod:`taskpoint.inspect.inventory` check names the same way without importing one another.
"""

from __future__ import annotations

import re

__all__ = ["check_name"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def check_name(what: str, value: object) -> str:
    """Return ``value`` if it is a usable name: letters, digits, ``_``, ``.`` and ``-``.

    Raises:
        ValueError: ``value`` is not such a string, or starts with ``_``, ``.`` or ``-``
            (``what`` names it in the message).
    """
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"{what} must be a non-empty string of letters, digits, '_', '.' and '-' "
            f"(it becomes part of the store path); got {value!r}"
        )
    return value

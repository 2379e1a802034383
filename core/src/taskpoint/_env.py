"""Settings read from environment variables: one parser for each kind of value."""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["seconds_from_env"]


def seconds_from_env(env: Mapping[str, str], name: str, default: float, must_be: str) -> float:
    """The positive, finite number of seconds the variable ``name`` holds in ``env``, or
    ``default`` where it is unset or blank.

    Args:
        env: the environment (``os.environ`` or a copy).
        name: the variable.
        default: seconds when it is unset or blank.
        must_be: what the error says the value must be (``"a positive number of seconds"``).

    Raises:
        ValueError: the variable is set to something else: ``"<name> must be <must_be>;
            got '<value>'"``.
    """
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be {must_be}; got {raw!r}")
    return value

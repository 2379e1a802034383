"""An action's history drawn for people: attempts, resumes and checkpoints in time order.

Pure functions: they take what :mod:`taskpoint.inventory` read and return rich renderables
or JSON-ready dicts; they perform no I/O. Every field may be missing (records written by
older versions, or damaged ones), and every value is shown whatever it is.
"""

from __future__ import annotations

import math

__all__ = ["age", "duration", "human_size"]


def human_size(size: int) -> str:
    """``size`` bytes as ``"12 B"``, ``"1.5 MiB"``... (TiB at most)."""
    if size < 1024:
        return f"{size} B"
    for unit, power in (("KiB", 1), ("MiB", 2), ("GiB", 3)):
        if size < 1024 ** (power + 1):
            return f"{size / 1024**power:.1f} {unit}"
    if size < 1024**5 * 10**6:
        return f"{size / 1024**4:.1f} TiB"
    return f"{size} B"


def age(seconds: float) -> str:
    """A coarse age: ``"5s"``, ``"3m"``, ``"2h"``, ``"4d"``."""
    if not math.isfinite(seconds):
        return "?"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def duration(seconds: float) -> str:
    """A precise duration: ``"12ms"``, ``"4.20s"``, ``"2m05s"``, ``"1h02m"``."""
    if not math.isfinite(seconds):
        return "?"
    sign, seconds = ("-", -seconds) if seconds < 0 else ("", seconds)
    if seconds < 1:
        text = f"{seconds * 1000:.0f}ms"
    elif seconds < 60:
        text = f"{seconds:.2f}s"
    elif seconds < 3600:
        text = f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    elif seconds < 86400 * 10**6:
        text = f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    else:
        text = "forever"
    return sign + text

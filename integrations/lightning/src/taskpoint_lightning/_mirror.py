"""Whether a checkpoint folder is fully written before it is mirrored: Lightning's
``AsyncCheckpointIO`` writes in a worker thread (:func:`flush_async_io` waits for it), and
another asynchronous plugin may leave a file half written (:func:`unfinished_files`).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from taskpoint.integration import list_files

from taskpoint_lightning._compat import loaded_classes

__all__ = ["flush_async_io", "unfinished_files"]

_ZIP_MAGIC = b"PK\x03\x04"


def flush_async_io(checkpoint_io: Any) -> int:
    """Wait for every write queued in the ``AsyncCheckpointIO`` plugins of the strategy's
    ``checkpoint_io`` (and those it wraps): each is torn down, which waits for its writes
    (it makes a fresh worker at its next save); how many were flushed.

    Raises:
        BaseException: whatever a queued write raised, re-raised by the plugin.
    """
    async_types = loaded_classes("plugins.io", "AsyncCheckpointIO")
    flushed = 0
    seen: set[int] = set()
    current = checkpoint_io
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if async_types and isinstance(current, async_types):
            current.teardown()  # type: ignore[attr-defined]
            flushed += 1
        current = getattr(current, "checkpoint_io", None)
    return flushed


def _looks_complete(path: Path) -> bool:
    """False for an empty file or a zip (``torch.save``'s format) without its end record."""
    try:
        with path.open("rb") as fh:
            head = fh.read(len(_ZIP_MAGIC))
    except OSError:
        return False
    if not head:
        return False
    if head == _ZIP_MAGIC:
        return zipfile.is_zipfile(path)
    return True  # another format: nothing to check it against


def unfinished_files(root: Path, written: Iterable[str | os.PathLike[str]] = ()) -> list[str]:
    """Why ``root`` cannot be mirrored yet, a line per file not fully written: files of
    ``written`` (reported saved) missing, links to missing files, ``.ckpt`` files empty or
    truncated zips; ``[]`` when complete. taskpoint's own ``.taskpoint-*`` entries (a job
    mirror's staged parts) are not looked at."""
    problems = [
        f"{os.fspath(p)} (reported saved but missing)"
        for p in written
        if p and not os.path.lexists(os.fspath(p))
    ]
    # list_files leaves out taskpoint's own staging folders, which uploads remove while this
    # looks (rglob raises when a folder it listed is gone), and tolerates files that vanish
    for path in (root / rel for rel in list_files(root)):
        if path.is_symlink():
            if not path.exists():
                problems.append(f"{path} (link to a missing file)")
        elif path.suffix == ".ckpt" and path.is_file() and not _looks_complete(path):
            problems.append(f"{path} (partially written)")
    return problems

"""Make sure a checkpoint folder is fully written before it is mirrored to the store.

Lightning's ``AsyncCheckpointIO`` writes checkpoint files in a worker thread, so when a
``ModelCheckpoint`` hook returns the file may not exist yet, or may exist half written.
:func:`flush_async_io` waits for those writes; :func:`unfinished_files` then looks for any
file that still looks partially written (from another asynchronous plugin), so the
mirror is put off rather than made of it.
"""

from __future__ import annotations

import os
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from taskpoint.integration import list_files

__all__ = ["flush_async_io", "unfinished_files"]

_ZIP_MAGIC = b"PK\x03\x04"
_IO_MODULES = ("lightning.pytorch.plugins.io", "pytorch_lightning.plugins.io")


def _async_io_types() -> tuple[type, ...]:
    """Lightning's ``AsyncCheckpointIO`` from each Lightning package already imported."""
    found = []
    for name in _IO_MODULES:
        module = sys.modules.get(name)
        cls = getattr(module, "AsyncCheckpointIO", None) if module is not None else None
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def flush_async_io(checkpoint_io: Any) -> int:
    """Wait for every checkpoint write still queued in ``checkpoint_io``'s async plugins.

    Walks the plugin and the plugins it wraps. Each ``AsyncCheckpointIO`` found is torn
    down, which waits for its queued writes; it makes a fresh worker at its next save.

    Args:
        checkpoint_io: the strategy's ``checkpoint_io``.

    Returns:
        How many asynchronous plugins were flushed.

    Raises:
        BaseException: whatever a queued write raised, re-raised by the plugin.
    """
    async_types = _async_io_types()
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
    """Why ``root`` cannot be mirrored yet: one line per file that is not fully written.

    Args:
        root: the checkpoint folder.
        written: files reported as saved, which must exist.

    Returns:
        Descriptions of missing files, links to missing files, and ``.ckpt`` files that
        are empty or truncated zip archives; empty when the folder is complete. taskpoint's
        own ``.taskpoint-*`` entries (a job mirror's staged parts) are not looked at.
    """
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

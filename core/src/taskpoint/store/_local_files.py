"""All-or-nothing writes of files on the local disk, for a store that is the local disk.

Both write a complete, fsync'ed temporary file next to the target first and then move it
into place in one step, so a reader (or a crash) sees either nothing or all of it:
:func:`replace` overwrites with ``os.replace``, :func:`link_new` creates only where
nothing exists yet, with ``os.link``. The temporary file never outlives the call.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterable

__all__ = ["link_new", "replace"]


def _temporary_name(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def _write_synced(path: str, parts: Iterable[bytes | memoryview]) -> None:
    with open(path, "wb") as fh:
        for part in parts:
            fh.write(part)
        fh.flush()
        os.fsync(fh.fileno())


def replace(path: str, parts: Iterable[bytes | memoryview]) -> None:
    """Put a file holding the concatenation of ``parts`` at ``path``, replacing any.

    Raises:
        OSError: the disk refused the write or the rename.
    """
    tmp = _temporary_name(path)
    try:
        _write_synced(tmp, parts)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def link_new(path: str, data: bytes) -> bool:
    """Put a complete file holding ``data`` at ``path`` unless something is there; whether
    this call put it there.

    Where the file system has no hard links (some network and FUSE file systems), the file
    is created with ``O_EXCL`` instead, which is exclusive but not all-or-nothing.

    Raises:
        OSError: the disk refused the write.
    """
    tmp = _temporary_name(path)
    try:
        _write_synced(tmp, [data])
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
                raise
            # No hard links here (some network and FUSE file systems): O_EXCL instead.
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)

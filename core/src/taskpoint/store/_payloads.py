"""Moving payloads between this machine and a store's location, one try at a time.

:class:`~taskpoint.store.store.Store` runs these under its retry policy. Uploads and downloads
go through :mod:`taskpoint.store.transfer` (multipart, resumable or block transfers on object
stores). An upload the object store lost midway is raised as the transient
:class:`~taskpoint.store.transfer.LostUpload`, so a retry starts it over, and a missing bucket
as such. :func:`abort_interrupted_uploads` clears what interrupted uploads left behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from taskpoint.store import transfer as _transfer
from taskpoint.store._location import Location

__all__ = [
    "abort_interrupted_uploads",
    "download",
    "put",
    "read",
    "read_memory",
    "upload_spool",
    "write_bytes",
]


def upload_spool(at: Location, spool: _transfer.Spool, name: str) -> None:
    """Upload a finished ``spool`` to ``name``: in one PUT when it stayed in memory, from
    its temporary file as :func:`put` otherwise."""
    if spool.path is None:
        _lost_upload_is_transient(at, lambda: write_bytes(at, name, spool.data))
    else:
        put(at, spool.path, name)


def write_bytes(at: Location, name: str, data: bytes | memoryview) -> None:
    """Write ``data`` to ``name`` in one PUT (``pipe_file``), watched for stalls on an
    asynchronous filesystem."""
    path = at.path(name)
    if at.is_async:
        at.watched(lambda progress: _transfer.put_bytes(at.fs, at.protocols, path, data, progress))
    else:
        at.fs.pipe_file(path, bytes(data))


def put(at: Location, local: str, name: str) -> None:
    """Upload the local file ``local`` to ``name``, in parallel parts where the backend can."""
    path = at.path(name)

    def upload() -> None:
        if at.is_async:
            at.watched(
                lambda progress: _transfer.put(
                    at.fs, at.protocols, at.transfer, local, path, progress
                )
            )
        else:
            _transfer.put_sync(at.fs, at.protocols, at.transfer, local, path)

    _lost_upload_is_transient(at, upload, local)
    at.invalidate(name)


def _lost_upload_is_transient(
    at: Location, upload: Callable[[], Any], local: str | None = None
) -> None:
    """Run ``upload``; a "not found" from an object store becomes a transient error.

    Uploading creates the object, so "not found" means a missing bucket (raised as
    such) or a multipart upload the store lost (a restart; an abort by a clean-up),
    which uploading again from the start mends.
    """
    try:
        upload()
    except FileNotFoundError as exc:
        if not at.is_object_store or (local is not None and not os.path.exists(local)):
            raise
        at.check_bucket(exc)
        raise _transfer.LostUpload(f"the store lost the upload in progress: {exc}") from exc


def abort_interrupted_uploads(at: Location, name: str, *, everything: bool = False) -> None:
    """Abort unfinished multipart uploads next to ``name`` that sort at or before it;
    with ``everything``, all of those under the prefix ``name``. Best effort (see
    :func:`taskpoint.store.transfer.abort_interrupted_uploads`)."""
    if everything:
        folder, last = name, None
    else:
        folder, _, last = name.rpartition("/")
    prefix = at.path(folder).rstrip("/") + "/"
    _transfer.abort_interrupted_uploads(
        at.fs, at.protocols, prefix, last, at.url_of(folder), at.stall_timeout
    )


def download(at: Location, name: str, local: str) -> None:
    """Download ``name`` to the local path ``local``, in parallel ranged parts where the
    backend can. Raises FileNotFoundError when ``name`` does not exist."""
    if at.is_memory:
        with open(local, "wb") as fh:
            fh.write(read_memory(at, name))
        return
    path = at.path(name)
    if at.is_async:
        at.watched(
            lambda progress: _transfer.get(at.fs, at.protocols, at.transfer, path, local, progress)
        )
    else:
        _transfer.get_sync(at.fs, at.protocols, at.transfer, path, local)


def read(at: Location, name: str, start: int | None = None, end: int | None = None) -> bytes:
    """Bytes ``start`` to ``end`` (exclusive) of ``name``, all of it by default; fewer
    where the object is shorter. Raises FileNotFoundError when ``name`` does not exist."""
    path = at.path(name)
    if at.is_async:
        return at.watched(
            lambda progress: _transfer.read(at.fs, at.protocols, path, start, end, progress)
        )
    return bytes(at.fs.cat_file(path, start=start, end=end))


def read_memory(at: Location, name: str) -> bytes:
    """A copy of the bytes of ``name`` on a ``memory://`` store.

    fsspec's memory filesystem hands every reader the same file object (and its position);
    concurrent readers would interleave, so the bytes are copied out instead.
    """
    return bytes(at.fs.cat_file(at.path(name)))

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

__all__ = ["abort_interrupted_uploads", "download", "put", "read_memory", "upload_spool"]


def upload_spool(at: Location, spool: _transfer.Spool, name: str) -> None:
    """Upload a finished ``spool`` to ``name``: in one PUT when it stayed in memory, from
    its temporary file as :func:`put` otherwise."""
    if spool.path is None:
        _lost_upload_is_transient(at, lambda: at.fs.pipe_file(at.path(name), spool.data))
    else:
        put(at, spool.path, name)


def put(at: Location, local: str, name: str) -> None:
    """Upload the local file ``local`` to ``name``, in parallel parts where the backend can."""
    path = at.path(name)
    _lost_upload_is_transient(
        at,
        lambda: _transfer.put(at.fs, at.protocols, at.transfer, local, path),
        local,
    )
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
    _transfer.abort_interrupted_uploads(at.fs, at.protocols, prefix, last, at.url_of(folder))


def download(at: Location, name: str, local: str) -> None:
    """Download ``name`` to the local path ``local``, in parallel ranged parts where the
    backend can. Raises FileNotFoundError when ``name`` does not exist."""
    if at.is_memory:
        with open(local, "wb") as fh:
            fh.write(read_memory(at, name))
        return
    _transfer.get(at.fs, at.protocols, at.transfer, at.path(name), local)


def read_memory(at: Location, name: str) -> bytes:
    """A copy of the bytes of ``name`` on a ``memory://`` store.

    fsspec's memory filesystem hands every reader the same file object (and its position);
    concurrent readers would interleave, so the bytes are copied out instead.
    """
    return bytes(at.fs.cat_file(at.path(name)))

"""Create-if-absent on every kind of store: of writers racing for one name, one wins.

Attempt claims and the clean-up lock rest on it (see :mod:`taskpoint.format.retention`). Each kind
of store has its own atomic step: on a local disk a complete temporary file is hard-linked
into place (:func:`taskpoint.store._local_files.link_new`); on ``memory://``, which lives in
this process alone, a lock; on object stores a conditional write (S3
``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``).
"""

from __future__ import annotations

import threading

from taskpoint.store import _local_files
from taskpoint.store._faults import status_of
from taskpoint.store._location import Location

__all__ = ["create_new"]

_MEMORY_CREATE = threading.Lock()
"""Serialises exclusive creates on ``memory://``, which lives in this process alone."""


def create_new(at: Location, name: str, data: bytes) -> bool:
    """One try at creating ``name`` holding ``data`` unless it exists; whether it did.

    Readers never see a partial object.

    Raises:
        Exception: whatever the store raised, for the caller to retry or translate; a
            "taken" answer (an existing name, HTTP 409 or 412) is ``False`` instead.
    """
    at.makedirs(name)
    path = at.path(name)
    if at.is_local:
        return _local_files.link_new(path, data)
    if at.is_memory:
        with _MEMORY_CREATE:
            if at.fs.exists(path):
                return False
            at.fs.pipe_file(path, data)
            return True
    try:
        at.call("pipe_file", path, data, mode="create")
    except FileExistsError:
        return False
    except Exception as exc:
        if status_of(exc) in (409, 412):  # taken, or a concurrent conditional write
            return False
        raise
    finally:
        at.invalidate(name)
    return True

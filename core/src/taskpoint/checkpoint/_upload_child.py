"""The upload process's program: what runs in the child :mod:`taskpoint.checkpoint._uploader`
starts.

The child's bootstrap (:data:`taskpoint.checkpoint._uploader.BOOTSTRAP`, a few lines of the
standard library only) imports this module, by its name
(:data:`~taskpoint.checkpoint._uploader.CHILD_MODULE`), on a thread at a lower priority,
calls :func:`warm_up`, then :func:`run`. Every import the upload process makes is one of
this module's, so ``tests/test_layers.py`` checks them as it checks any module's: the
upload process runs code of the checkpoint layer and below, never a face above it.

Each request is committed by a :class:`~taskpoint.checkpoint._save.Saver` built straight
from the request's :class:`~taskpoint.checkpoint._uploader.Destination`: the same ``commit``
a save in the training process runs, with no :class:`~taskpoint.Checkpoint` rebuilt
around it.
"""

from __future__ import annotations

import contextlib
import threading

from taskpoint import _scratch
from taskpoint.checkpoint import _inflight, _uploader
from taskpoint.checkpoint._save import Saver
from taskpoint.format import archive
from taskpoint.format._catalog import Catalog
from taskpoint.format.history import SaveStats
from taskpoint.store.store import Store

__all__ = ["commit", "handle", "open_store", "run", "warm_up"]


def warm_up(protocols: list[str]) -> None:
    """Import, before the child says it is ready, each storage backend of ``protocols``
    (fsspec's, e.g. ``s3``). A protocol that does not import is left for the request to
    report."""
    import fsspec

    for protocol in protocols:
        with contextlib.suppress(Exception):
            fsspec.get_filesystem_class(protocol)


def open_store(destination: _uploader.Destination) -> None:
    """Open ``destination``'s store and its client now, ahead of its first save (see
    :meth:`taskpoint.store.store.Store.warm`): the saves' stores share the filesystem
    instance fsspec keeps for the same URL and options. Never fails; a failure is the first
    save's to report."""
    thread = Store(destination.url, destination.storage_options, destination.retry).warm()
    if thread is not None:
        thread.join()


_stops: dict[str, threading.Event] = {}
"""The stop of each save committing now, by its ``stop_key``, and of each save a
:class:`~taskpoint.checkpoint._uploader.Stop` named before the save's own thread began:
the parent sends it right after the save, and this process answers each message on a
thread of its own, in no set order. A save removes its entry when it ends; a stop that
comes after that leaves one behind (a few hundred bytes, and the save is done)."""


def handle(message: _uploader.Message) -> object:
    """Answer one message of the parent's: commit a save (:func:`commit`), open a
    destination's store ahead of its saves (:func:`open_store`), or stop a save (both
    answered with ``None``)."""
    if isinstance(message, _uploader.Destination):
        open_store(message)
        return None
    if isinstance(message, _uploader.Stop):
        _stops.setdefault(message.key, threading.Event()).set()
        return None
    return commit(message)


def commit(request: _uploader.Request) -> tuple[SaveStats, tuple[str, str]]:
    """Commit one background save in the upload process.

    Marks the upload as in flight for its location (:func:`taskpoint.checkpoint._inflight.hold`),
    so a retry on this machine waits for it, and holds the save's snapshot while it commits
    (:func:`taskpoint._scratch.adopt`): one whose training process died meanwhile
    is removed here once the commit ends, since no one else will.

    Returns:
        The save's stats and its ``(manifest key, checksum)``, for the parent to record.

    Raises:
        CheckpointError: what :meth:`taskpoint.checkpoint._save.Saver.commit` raised.
    """
    snapshot = request.source.snapshot
    if snapshot is not None:
        _scratch.adopt(snapshot)
    key = request.stop_key
    stop = None if key is None else _stops.setdefault(key, threading.Event())
    try:
        where = request.destination
        catalog = Catalog(Store(where.url, where.storage_options, where.retry))
        catalog.intact |= request.intact
        saver = Saver(
            catalog, codec=archive.check_codec(where.codec), store_format=where.store_format,
            keep=where.keep,
        )
        with _inflight.hold(catalog.store.url):
            return saver.commit(request.source, request.attempt, request.seq, stop)
    finally:
        if key is not None:
            _stops.pop(key, None)
        if snapshot is not None:
            _scratch.let_go(snapshot)


def run() -> int:
    """Serve requests until the parent closes the child's input (see
    :func:`taskpoint.checkpoint._uploader.main`); the child's exit status."""
    import fsspec.asyn

    fsspec.asyn.get_loop()  # its thread starts here, at the parent's priority
    return _uploader.main(handle)

"""The save path: what a save takes, its snapshot, writing it, the commit, background saves.

A save is classified (:func:`classify`), snapshotted when it runs in the background
(:func:`take_snapshot`), then committed by a :class:`Saver`: a format-2 directory through
:func:`taskpoint.format._tree_save.save_tree` under a
:class:`taskpoint.format.retention.Lease`, anything else as one format-1 payload (bytes, a
file, or a tar archive of a directory) under a fresh name. The manifest, written last, is
the commit; then older checkpoints are pruned. An
:class:`~taskpoint.checkpoint._upload_thread.UploadThread` runs background saves, holding at
most one queued; :mod:`taskpoint.checkpoint._uploader` runs a
:class:`Saver` in the process's upload process instead. :class:`Saves` runs one checkpoint's
saves one at a time: it numbers each, commits it in the caller's thread, on the upload
thread or in the upload process, and tells the checkpoint's ``on_commit`` listeners; once
closed it takes no more.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from taskpoint import _scratch, preemption
from taskpoint.checkpoint import _settle, _uploader
from taskpoint.checkpoint._upload_thread import UploadThread, run_niced
from taskpoint.checkpoint._uploader import DEFAULT_UPLOAD_NICE, UPLOAD_NICE_ENV, upload_nice
from taskpoint.distributed import _parts
from taskpoint.errors import (
    CheckpointClosedError,
    CheckpointSaveError,
    _save_failures,
    _SaveStopped,
)
from taskpoint.format import _payload, _tree_save, archive, retention
from taskpoint.format._catalog import Catalog
from taskpoint.format._digest import Progress
from taskpoint.format._statcache import ContentKey, StatCache, content_key
from taskpoint.format.history import Attempt, SaveStats
from taskpoint.format.manifest import (
    CHECKPOINTS,
    TREE_FORMAT,
    Codec,
    Manifest,
    manifest_name,
    payload_name,
    tree_checksum,
)
from taskpoint.progress import current_step

__all__ = [
    "DEFAULT_UPLOAD_NICE",
    "UPLOAD_NICE_ENV",
    "WHEN_BUSY",
    "Saver",
    "Saves",
    "Snapshot",
    "Source",
    "WhenBusy",
    "check_snapshot",
    "check_when_busy",
    "classify",
    "discard",
    "take_snapshot",
    "upload_nice",
]

log = logging.getLogger(__name__)

RATE_MIN_BYTES = 1 << 20
"""A commit that uploaded less than this (bytes) tells nothing of the link's rate: its
round trips, not its bytes, took the time."""

WhenBusy = Literal["coalesce", "wait"]
"""What a background save asked for while an earlier one still uploads does (see
:class:`taskpoint.Checkpoint`)."""
WHEN_BUSY: tuple[WhenBusy, ...] = ("coalesce", "wait")
WHEN_BUSY_ENV = "TASKPOINT_WHEN_BUSY"
"""The environment variable that sets ``when_busy`` where the constructor is not given it."""


def check_when_busy(value: object) -> WhenBusy:
    """``value`` (``None``: :data:`WHEN_BUSY_ENV`, else ``"coalesce"``) as a ``when_busy``.

    Raises:
        ValueError: it is neither ``"coalesce"`` nor ``"wait"``.
    """
    origin = "when_busy"
    if value is None:
        value = os.environ.get(WHEN_BUSY_ENV, "").strip() or "coalesce"
        origin = WHEN_BUSY_ENV
    if value not in WHEN_BUSY:
        raise ValueError(
            f'{origin} must be "coalesce" (a background save asked for while one uploads '
            'replaces the one waiting behind it; training never waits) or "wait" (it waits '
            f"for the upload in flight); got {value!r}"
        )
    return value


@dataclass(frozen=True)
class Source:
    """What one save commits: bytes, or a file or directory (perhaps a private snapshot)."""

    kind: str
    data: bytes | None = None
    path: Path | None = None
    snapshot: Path | None = None  # a private copy's folder, removed once uploaded
    called: float = 0.0  # time.monotonic() when save was called
    blocked_s: float | None = None  # how long a background save held its caller
    pinned: dict[str, ContentKey] | None = None  # a link snapshot's files, as linked
    step: int | None = field(default_factory=current_step)  # reported at the call
    preemption: bool = field(default_factory=preemption.requested)  # called after SIGTERM
    coalesced: int = 0  # background saves this one replaced since the previous commit


def classify(data: object, called: float) -> Source:
    """What ``data`` is, as :meth:`taskpoint.Checkpoint.save_sync` takes it.

    Args:
        data: bytes-like, or the path of a file or directory.
        called: ``time.monotonic()`` when the save was called.

    Raises:
        TypeError: ``data`` is of another type.
        FileNotFoundError: the path does not exist.
        ValueError: the path is neither a regular file nor a directory.
        CheckpointUnsafeError: the directory holds a special file or a link leaving it.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        return Source("bytes", data=bytes(data), called=called)
    if isinstance(data, (str, os.PathLike)):
        path = Path(os.fspath(data))
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise FileNotFoundError(
                f"cannot checkpoint {str(path)!r}: no such file or directory"
            ) from None
        if stat.S_ISDIR(mode):
            archive.check_tree(path)
            return Source("directory", path=path.absolute(), called=called)
        if stat.S_ISREG(mode):
            return Source("file", path=path.absolute(), called=called)
        raise ValueError(
            f"cannot checkpoint {str(path)!r}: it is neither a regular file nor a directory"
        )
    raise TypeError(
        "checkpoint save() takes bytes, bytearray or memoryview (stored as raw bytes) or a "
        f"str / os.PathLike naming a file or directory; got {type(data).__name__}"
    )



class Saver:
    """Writes and commits saves to one location.

    Args:
        catalog: the location's committed checkpoints (updated with each commit).
        codec: how format-1 directory archives and format-2 blobs are compressed.
        store_format: 1 (one payload per checkpoint) or 2 (content-addressed trees).
        keep: how many intact checkpoints a commit keeps.
        progress: called with the number of payload bytes moved.
        seen: files known unchanged by their stat, shared with the checkpoint's loader
            (see :mod:`taskpoint.format._statcache`); each committed tree's files are recorded.
    """

    def __init__(
        self,
        catalog: Catalog,
        *,
        codec: Codec,
        store_format: int,
        keep: int,
        progress: Progress | None = None,
        seen: StatCache | None = None,
    ) -> None:
        self._seen = seen
        self._catalog = catalog
        self._store = catalog.store
        self._codec = codec
        self._store_format = store_format
        self._keep = keep
        self._progress = progress

    def commit(
        self, source: Source, attempt: int, seq: int, stop: threading.Event | None = None
    ) -> tuple[SaveStats, tuple[str, str]]:
        """Write ``source`` as save ``seq`` of ``attempt``, commit it, prune.

        Called with the checkpoint's save lock held (or in the upload process). A format-2
        tree's upload ends early, uncommitted, once ``stop`` is set: between its pack
        objects, so within about one pack's upload per worker (a payload ignores it).

        Returns:
            The save's stats and its ``(manifest key, checksum)``.

        Raises:
            CheckpointStoreError: the store failed; earlier checkpoints are untouched.
            CheckpointSaveError: anything else failed (a source file vanished or could
                not be read, or an internal error); nothing was committed.
            CheckpointError: any other of taskpoint's own, as raised (``_SaveStopped``
                after ``stop``).
        """
        what = f"saving {source.kind} checkpoint {seq} of attempt {attempt}"
        with _save_failures(self._store.url, what):
            if source.kind == "directory" and self._store_format == TREE_FORMAT:
                committed = self._save_tree(source, attempt, seq, stop)
            else:
                committed = self._save_payload(source, attempt, seq)
        self.prune()
        return committed

    def prune(self) -> None:
        """Keep the newest ``keep`` intact checkpoints; collect content if any was freed."""
        if self._catalog.prune(self._keep) and self._store.list(retention.OBJECTS):
            self._catalog.collect()

    def _save_tree(
        self, source: Source, attempt: int, seq: int, stop: threading.Event | None = None
    ) -> tuple[SaveStats, tuple[str, str]]:
        """Commit a format-2 tree: content the run holds is referenced, the rest uploaded."""
        assert source.path is not None
        key = f"{CHECKPOINTS}/{manifest_name(attempt, seq)}"
        with retention.Lease(self._store, attempt, seq) as lease:
            upload_started = time.monotonic()
            known = _tree_save.BlobIndex.of(self._catalog.read_committed())
            saved = _tree_save.save_tree(
                self._store, source.path, known, codec=self._codec,
                workers=self._store.transfer.concurrency, progress=self._progress,
                seen=self._seen, pinned=source.pinned, stop=stop,
            )
            stats = SaveStats(
                url=self._store.url_of(key), attempt=attempt, seq=seq, kind=source.kind,
                size=saved.size, uploaded=saved.uploaded, reused=saved.reused, save_s=0.0,
                upload_s=0.0, blocked_s=0.0, background=source.blocked_s is not None,
                coalesced=source.coalesced,
            )
            manifest = Manifest(
                kind="directory", name=source.path.name, codec="none", size=saved.size,
                checksum=tree_checksum(saved.entries), payload=None, attempt=attempt, seq=seq,
                created=time.time(), format=TREE_FORMAT,
                stats=self._timed(stats, source, upload_started).to_record(),
                entries=saved.entries, objects=saved.objects,
                step=source.step, preemption=source.preemption,
            )
            lease.check()
            self._store.write_atomic(key, manifest.to_json())
        self._catalog.remember(manifest)
        if self._seen is not None and source.snapshot is None:  # a snapshot is gone next time
            self._seen.replace(source.path, saved.seen)
        stats = self._timed(stats, source, upload_started)
        log.info(
            "committed directory checkpoint %s (%d bytes, %d uploaded) in %.2fs",
            stats.url, saved.size, saved.uploaded, stats.save_s,
        )
        return stats, (manifest.key, manifest.checksum)

    def _save_payload(
        self, source: Source, attempt: int, seq: int
    ) -> tuple[SaveStats, tuple[str, str]]:
        token = uuid.uuid4().hex[:8]
        payload = payload_name(attempt, seq, token)
        upload_started = time.monotonic()
        digest, name, codec = _payload.write_payload(
            self._store, f"{CHECKPOINTS}/{payload}", kind=source.kind, data=source.data,
            path=source.path, codec=self._codec, progress=self._progress,
        )
        if source.path is not None and source.pinned:  # read whole before the check
            for rel, pin in source.pinned.items():
                _tree_save.check_pinned(
                    source.path, rel, _tree_save.content_now(source.path / rel), pin,
                    url=self._store.url,
                )
        key = f"{CHECKPOINTS}/{manifest_name(attempt, seq)}"
        stats = SaveStats(
            url=self._store.url_of(key),
            attempt=attempt,
            seq=seq,
            kind=source.kind,
            size=digest.size,
            uploaded=digest.size,
            reused=0,
            save_s=0.0,
            upload_s=0.0,
            blocked_s=0.0,
            background=source.blocked_s is not None,
            coalesced=source.coalesced,
        )
        manifest = Manifest(
            kind=source.kind,  # type: ignore[arg-type]
            name=name,
            codec=codec,
            size=digest.size,
            checksum=digest.checksum,
            payload=payload,
            attempt=attempt,
            seq=seq,
            created=time.time(),
            stats=self._timed(stats, source, upload_started).to_record(),
            step=source.step,
            preemption=source.preemption,
        )
        self._store.write_atomic(key, manifest.to_json())
        self._catalog.intact.add((manifest.key, manifest.checksum))
        stats = self._timed(stats, source, upload_started)
        log.info(
            "committed %s checkpoint %s (%d bytes) in %.2fs",
            source.kind, stats.url, digest.size, stats.save_s,
        )
        return stats, (manifest.key, manifest.checksum)

    @staticmethod
    def _timed(stats: SaveStats, source: Source, upload_started: float) -> SaveStats:
        now = time.monotonic()
        save_s = now - source.called
        return dataclasses.replace(
            stats,
            save_s=save_s,
            upload_s=now - upload_started,
            blocked_s=save_s if source.blocked_s is None else source.blocked_s,
        )


LINK_MIN = 1 << 20
"""A ``"link"`` snapshot copies files smaller than this (bytes) instead of linking them:
copying them costs little, and small files (a model card, a trainer state) are the ones
frameworks rewrite in place, which a linked file cannot survive."""

Snapshot = Literal["copy", "link"]
"""How a background save snapshots a path (see :meth:`taskpoint.Checkpoint.save_sync`)."""


def check_snapshot(snapshot: object) -> None:
    """Raises ValueError unless ``snapshot`` is ``"copy"`` or ``"link"``."""
    if snapshot not in ("copy", "link"):
        raise ValueError(f'snapshot must be "copy" or "link"; got {snapshot!r}')


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def take_snapshot(source: Source, how: Snapshot = "copy") -> Source:
    """A private snapshot of ``source`` that later changes to the original cannot reach.

    ``how="link"`` hard-links files of :data:`LINK_MIN` bytes or more and copies smaller
    ones (see :meth:`taskpoint.Checkpoint.save_sync`); it is placed beside the original, on
    its file system, so links are possible (:func:`taskpoint._scratch.snapshot_parent`).
    Each linked file's content key is recorded (``pinned``): a file rewritten in place
    through the original's name before the snapshot is committed fails that commit rather
    than storing content that is not the snapshot's (perhaps half written).

    Raises:
        CheckpointSaveError: a file could not be read or copied; nothing is left behind.
    """
    if source.path is None:
        return dataclasses.replace(source, blocked_s=time.monotonic() - source.called)
    try:
        near = _scratch.snapshot_parent(source.path) if how == "link" else None
        folder = _scratch.owned_folder(_scratch.SNAPSHOT_PREFIX, near)
    except OSError:  # a read-only parent: a copy in the temporary folder instead
        folder, how = _scratch.owned_folder(_scratch.SNAPSHOT_PREFIX), "copy"
    target = folder / source.path.name
    linked: dict[str, ContentKey] = {}

    def link(src: str, dst: str) -> None:
        if os.lstat(src).st_size < LINK_MIN:  # cheap to copy, and often rewritten in place
            shutil.copy2(src, dst, follow_symlinks=False)
            return
        _link_or_copy(src, dst)
        info = os.lstat(dst)
        if info.st_nlink > 1:  # shared with the original: pin the content it has now
            linked[Path(dst).relative_to(target).as_posix()] = content_key(info)

    copy = link if how == "link" else shutil.copy2
    try:
        if source.kind == "directory":
            shutil.copytree(source.path, target, symlinks=True, copy_function=copy)
        else:
            copy(str(source.path), str(target))
    except OSError as exc:  # shutil.Error, which gathers a tree's failures, is one too
        _scratch.remove(folder)
        raise CheckpointSaveError(
            f"could not snapshot {source.path} for a background save ({type(exc).__name__}: "
            f"{exc}); nothing was queued",
            url=None,
        ) from exc
    return Source(
        source.kind, path=target, snapshot=folder, called=source.called,
        blocked_s=time.monotonic() - source.called, pinned=linked or None,
        step=source.step, preemption=source.preemption, coalesced=source.coalesced,
    )


def discard(source: Source) -> None:
    """Remove ``source``'s private snapshot, if it has one."""
    if source.snapshot is not None:
        _scratch.remove(source.snapshot)


class Saves:
    """One checkpoint's saves, one at a time: numbered, committed, announced.

    A save commits in its caller's thread, or (a background save) on the
    :class:`~taskpoint.checkpoint._upload_thread.UploadThread`, which hands it to the
    process's upload process (:mod:`taskpoint.checkpoint._uploader`) when it can: the first
    background save starts that process without waiting for it, and saves commit on the
    thread itself until it is ready. A background save asked for while another still uploads replaces the
    one pending behind it (``when_busy="coalesce"``) or waits for the upload in flight
    (``"wait"``). Background saves no one waits for run :func:`upload_nice` below the
    caller's priority; a preemption save (asked for after the signal) never does. A multi-writer commit (:class:`taskpoint.PartsCommit`) takes its numbers here
    too. Each commit is announced to the :meth:`on_commit` listeners. Interpreter exit
    waits for the background saves (see :mod:`taskpoint.checkpoint._settle`).

    Args:
        saver: writes and commits one save.
        catalog: the location's committed checkpoints (the saver's).
        attempt: the checkpoint's attempt, which numbers the saves.
        destination: where and how the upload process commits these saves.
        background_upload: where background saves upload: ``"process"`` or ``"thread"``.
        when_busy: what a background save asked for during an upload does: ``"coalesce"``
            or ``"wait"`` (see :class:`taskpoint.Checkpoint`).
    """

    def __init__(
        self,
        saver: Saver,
        catalog: Catalog,
        attempt: Attempt,
        *,
        destination: _uploader.Destination,
        background_upload: str,
        when_busy: WhenBusy = "coalesce",
    ) -> None:
        self.when_busy: WhenBusy = when_busy
        self.saver = saver
        self._catalog = catalog
        self._attempt = attempt
        self._destination = destination
        self._store_opened = False  # whether prepare() had the upload process open the store
        self._background_upload = background_upload
        self.process_uploads = 0
        """How many saves were sent to the upload process."""
        self.last_commit: SaveStats | None = None
        """The figures of this process's newest commit."""
        self.restored: tuple[int, float, dict[str, Any] | None] | None = None
        """The checkpoint this process restored: its size, the seconds the restore took
        and its manifest's ``stats`` (what that save cost), for a first save's estimate."""
        self._lock = threading.Lock()  # held while a save commits
        self._committing: tuple[int, threading.Event, _uploader.Worker | None, str] | None = None
        """The background save committing now, as :meth:`_stop_committing` stops it: its
        ticket, its stop event, and the upload process it commits in (``None``: this
        process) with the key it commits under there."""
        self._state = threading.Lock()  # guards _closed
        self._closed = False
        self._released = False  # let go of the upload process since the last save began
        self._tickets = itertools.count()
        self._issued = 0  # tickets given so far
        self._stop_before = 0  # background saves with a lower ticket stop (see make_way)
        self._stopping = threading.Lock()  # guards _stop_before and _committing
        self._background = UploadThread("taskpoint-background-save", nice=False)  # run() nices
        self._idle = _Idle(self._background)
        self._listeners: list[Callable[[SaveStats], object]] = []
        _settle.track(self._idle)  # waited for at interpreter exit
        if background_upload == "process" and catalog.progress is None:
            # Keeps the upload process, once started, until closed (the store is not
            # opened here: a bad URL fails at first use).
            _uploader.shared().add_user(self)

    def begin(self, data: object, snapshot: object, background: bool) -> tuple[Source, int]:
        """Check and classify a save of ``data`` and give it its ticket (its place in
        order); a blocking save drops an older background save still queued.

        Raises:
            TypeError, ValueError, FileNotFoundError, CheckpointUnsafeError: as
                :meth:`taskpoint.Checkpoint.save_sync` says.
            CheckpointError: what an earlier background save raised.
            ValueError: ``TASKPOINT_UPLOAD_NICE`` is unusable (a background save).
        """
        called = time.monotonic()
        check_snapshot(snapshot)
        self.check_open()
        self.raise_error()
        if background:
            upload_nice()  # a bad setting fails the call, not the upload
            if self.when_busy == "wait":
                self._background.wait()  # the old way: training waits for the upload
        source = classify(data, called)
        ticket = self._next_ticket()
        if not background:
            self._background.supersede(ticket)
        else:  # while the snapshot is taken (a copy: outside the GIL); neither waits
            self._released = False
            if self._upload_in_process:
                _uploader.shared().start(self._protocols, user=self)
            self._attempt.claim_soon()  # a first save's claim: the client's import, requests
        return source, ticket

    def prepare(self) -> None:
        """Start the upload process now if background saves would use it (a job loads its
        checkpoint before it trains), so that the first background saves find it ready:
        one committed from a thread while it starts dies with a killed training process,
        and has it open this checkpoint's store there (its client is a first save's cost)."""
        if self._upload_in_process and not self._closed:
            self._released = False
            worker = _uploader.shared()
            worker.start(self._protocols, user=self)  # never waits
            if not self._store_opened:
                self._store_opened = True
                worker.open_store(self._destination)

    def queue(self, source: Source, ticket: int) -> None:
        """Commit ``source`` (a private snapshot) on the upload thread.

        Raises:
            CheckpointClosedError: the saves were closed meanwhile (the snapshot is removed).
        """
        with self._state:
            if not self._closed:
                self._background.start(
                    lambda: self._run_queued(source, ticket),
                    on_drop=lambda: discard(source), ticket=ticket,
                    stop=lambda: self._give_way(ticket),
                )
                return
        discard(source)
        self.check_open()

    def run(self, source: Source, ticket: int) -> None:
        """Commit ``source`` now: in the upload process if it is a background save that
        can go there, else in this thread; then tell the listeners.

        A blocking save (training waits for it: a preemption save is one) first stops the
        background save still uploading, under ``when_busy="coalesce"``: that one holds an
        older state, and would make training wait for its upload too. It ends uncommitted,
        counted as coalesced, and this save commits at once."""
        background = source.blocked_s is not None
        if not background and self.when_busy == "coalesce":
            self._stop_committing(ticket)
        # Training waits for a blocking save and for a preemption save: neither is niced.
        nice = upload_nice() if background and not source.preemption else 0
        with self._lock:
            if not background:
                source = dataclasses.replace(source, coalesced=self._background.take_coalesced())
            stop = self._committing_now(ticket) if background else None
            try:
                if stop is not None and stop.is_set():
                    raise _SaveStopped("stopped before it began")
                attempt, seq = self._attempt.next_save(ticket)
                worker = self._worker() if background else None
                if worker is not None and stop is not None:
                    key = f"{os.getpid()}.{id(stop)}"
                    if self._committing_now(ticket, stop, worker, key).is_set():
                        raise _SaveStopped("stopped before it was sent")
                    request = _uploader.Request(
                        self._destination, attempt, seq, source, frozenset(self._catalog.intact),
                        nice=nice, stop_key=key,
                    )
                    self.process_uploads += 1
                    stats, intact = worker.run(request)
                    self._catalog.intact.add(intact)
                else:  # a blocking save, or the upload process is not (yet) there
                    stats, _ = run_niced(
                        lambda: self.saver.commit(source, attempt, seq, stop), nice
                    )
            except _SaveStopped:
                self._stopped(ticket)
                return
            finally:
                with self._stopping:
                    self._committing = None
        self._notify(stats)

    def _stopped(self, ticket: int) -> None:
        """Count the background save ``ticket``, stopped, as coalesced."""
        self._background.note_coalesced()
        log.info(
            "%s: stopped background save %d for a newer save training waits for",
            self._catalog.store.url, ticket,
        )

    def _give_way(self, ticket: int) -> None:
        """Stop the background save ``ticket`` for a newer one waiting behind it, which a
        caller waits for (:meth:`UploadThread.idle`); under ``when_busy="coalesce"`` only:
        ``"wait"`` commits every save."""
        if self.when_busy == "coalesce":
            self._stop_committing(ticket + 1)

    def make_way(self) -> None:
        """Drop the background save waiting and stop every one asked for so far (see
        :func:`taskpoint.checkpoint.mirror.make_way`); never waits."""
        self._background.drop_pending()
        self._stop_committing(self._issued)

    def _next_ticket(self) -> int:
        """A new save's ticket: its place in the order saves were asked for."""
        ticket = next(self._tickets)
        self._issued = ticket + 1
        return ticket

    def _committing_now(
        self,
        ticket: int,
        stop: threading.Event | None = None,
        worker: _uploader.Worker | None = None,
        key: str = "",
    ) -> threading.Event:
        """Record the background save ``ticket`` as the one committing now, with its stop
        event (a new one unless given), and the upload process and key it commits under
        there once known; the event, set if a stop already came for it."""
        stop = threading.Event() if stop is None else stop
        with self._stopping:
            if ticket < self._stop_before:
                stop.set()
            self._committing = (ticket, stop, worker, key)
        return stop

    def _stop_committing(self, ticket: int) -> None:
        """Stop the background saves asked for before the save numbered ``ticket``: the
        one committing now, and any that begins later (see :meth:`run`); never waits for
        them to end."""
        with self._stopping:
            self._stop_before = max(self._stop_before, ticket)
            committing = self._committing
            if committing is None or committing[0] >= ticket:
                return
            _, stop, worker, key = committing
            stop.set()
        if worker is not None:  # else it is not sent yet, or commits in this process
            worker.stop(key)

    def _run_queued(self, source: Source, ticket: int) -> None:
        """A background save on the upload thread: :meth:`run` it, counting the saves it
        replaced while it waited, then remove its snapshot."""
        try:
            self.run(dataclasses.replace(source, coalesced=self._background.replaced), ticket)
        finally:
            discard(source)

    def _worker(self) -> _uploader.Worker | None:
        """The upload process for a background save, once it is ready; ``None`` while it
        starts (it is started if need be): the save then commits in this thread rather than
        wait for it. A save begun before :meth:`release` uses it without taking it up again."""
        if not self._upload_in_process:
            return None
        worker = _uploader.shared()
        worker.start(self._protocols, user=None if self._released else self)  # never waits
        return worker if worker.ready else None

    @property
    def _protocols(self) -> tuple[str, ...]:
        """The fsspec protocol of this checkpoint's store, for the upload process to import
        before it is ready."""
        return (self._catalog.store.url.split("://", 1)[0],) if "://" in self._catalog.store.url else ()

    @property
    def _upload_in_process(self) -> bool:
        """Whether background saves run in the upload process (see
        :mod:`taskpoint.checkpoint._uploader`)."""
        if self._background_upload != "process" or self._catalog.progress is not None:
            return False  # a progress callback cannot cross processes
        if self._catalog.store.is_memory:
            return False  # memory:// lives in this process alone
        try:
            pickle.dumps(self._destination)
        except Exception:  # storage_options holding a live client object, say
            self._background_upload = "thread"
            return False
        return True

    def drop_waiting(self) -> bool:
        """Drop the background save waiting behind the upload in flight (it is coalesced,
        counted by the next commit): a preemption save about to be made goes first.
        Returns whether one was waiting."""
        return self._background.drop_pending()

    def note_coalesced(self, count: int = 1) -> None:
        """Count ``count`` background saves an adapter replaced before they reached this
        checkpoint: the next save to commit reports them."""
        self._background.note_coalesced(count)

    def upload_rate(self) -> float | None:
        """The link's upload rate as this process knows it (bytes per second): from its
        newest commit, else from the stats of the checkpoint it restored (what that save
        cost, in an earlier process), else from that restore's own rate; ``None`` when it
        knows none (nothing saved or restored yet)."""
        commit = self.last_commit
        if commit is not None and commit.uploaded >= RATE_MIN_BYTES and commit.upload_s > 0:
            return commit.uploaded / commit.upload_s
        if self.restored is None:
            return None
        size, restore_s, stats = self.restored
        if stats:
            uploaded, upload_s = stats.get("uploaded"), stats.get("upload_s")
            if (
                isinstance(uploaded, int) and isinstance(upload_s, (int, float))
                and uploaded >= RATE_MIN_BYTES and upload_s > 0
            ):
                return uploaded / float(upload_s)
        return size / restore_s if size > 0 and restore_s > 0 else None

    def begin_parts(self, called: float) -> _parts.PartsCommit:
        """Number a multi-writer commit, begun at ``called`` (``time.monotonic()``), and
        start it (see :meth:`taskpoint.Checkpoint.begin_parts`).

        Raises:
            CheckpointClosedError: the saves were closed.
        """
        self.check_open()
        ticket = self._next_ticket()
        self._background.supersede(ticket)
        with self._lock:
            attempt, seq = self._attempt.next_save(ticket)
        return _parts.PartsCommit(
            self._catalog, attempt, seq, called=called, committed=self._parts_committed
        )

    def _parts_committed(self, stats: SaveStats) -> None:
        with self._lock:
            self.saver.prune()
        self._notify(stats)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until background saves have committed, for at most ``timeout`` seconds
        (``None``: no limit); raise what the last failed one raised. Whether none runs."""
        return self._background.wait(timeout)

    def close(self) -> None:
        """Take no more saves; wait for those queued or in flight (see
        :meth:`taskpoint.Checkpoint.close`). A second call does nothing.

        Raises:
            CheckpointError: what the last failed background save raised.
        """
        with self._state:
            if self._closed:
                return
            self._closed = True
        try:
            self._background.idle()
            with self._lock:  # a blocking save another thread had started has committed
                pass
        finally:
            _settle.untrack(self._idle)
            _uploader.shared().release(self)  # unused, the upload process ends
        self.raise_error()

    def release(self) -> None:
        """Let go of the upload process, staying open (see
        :meth:`taskpoint.Checkpoint.release`): saves begun before still commit through it;
        the next background save (or :meth:`prepare`) takes it up again. Never waits."""
        with self._state:
            if self._closed:
                return  # closing let go already
            self._released = True
        _uploader.shared().release(self, at_once=True)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def check_open(self) -> None:
        """Raises CheckpointClosedError once :meth:`close` was called."""
        if self._closed:
            url = self._catalog.store.url
            raise CheckpointClosedError(
                f"cannot save: Checkpoint({url!r}) was closed; make a new Checkpoint to "
                "save there again",
                url=url,
            )

    def raise_error(self) -> None:
        """Raise what the last failed background save raised, once."""
        self._background.raise_error()

    def on_commit(self, callback: Callable[[SaveStats], object]) -> None:
        """Call ``callback`` with each commit's stats (see
        :meth:`taskpoint.Checkpoint.on_commit`)."""
        self._listeners.append(callback)

    def _notify(self, stats: SaveStats) -> None:
        self.last_commit = stats
        for listener in list(self._listeners):
            try:
                listener(stats)
            except Exception:
                log.exception("an on_commit listener of %s failed", self._catalog.store.url)


class _Idle:
    """A checkpoint's upload thread as :func:`taskpoint.checkpoint._settle.track` waits
    for it: a failed save's error stays for the checkpoint's next save or ``wait``."""

    def __init__(self, thread: UploadThread) -> None:
        self._thread = thread

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the thread's saves have finished within ``timeout`` seconds."""
        return self._thread.idle(timeout)

"""``Checkpoint``: save in-progress state to a store, load the newest intact one back.

Example::

    import taskpoint

    ckpt = taskpoint.Checkpoint("s3://bucket/jobs/train-42")
    prev = ckpt.load_sync()              # pathlib.Path, or None on the first attempt
    start = int(prev.read_bytes()) if prev else 0
    for step in range(start, 100):
        ...
        ckpt.save_sync(str(step + 1).encode())

Inside a task, ``taskpoint.ctx().checkpoint`` is a ``Checkpoint`` already bound to the
action's location and attempt. Outside one, ``with Checkpoint(url) as ckpt:`` closes it at
the end of the block, once its background saves have committed.

A save writes the payload under a fresh name, then its manifest (the commit), then prunes
checkpoints beyond the newest ``keep``. A crash at any point leaves the newest committed
checkpoint loadable; a reader never sees a half-written one.

``Checkpoint`` is the public face. This module holds its construction, copies, closing
and saves; it inherits its other methods, a job to a module: loading
(:class:`taskpoint.checkpoint._load.Loading`), saving one checkpoint from several
processes (:class:`taskpoint.checkpoint._multiwriter.MultiWriter`), the run records
(:class:`taskpoint.checkpoint._records.Records`), and the checkpoints stored
(:class:`taskpoint.checkpoint._stored.Stored`).

The work is done by its collaborators: saves by :class:`taskpoint.checkpoint._save.Saves`
(ordering, background and upload-process saves, listeners) and
:class:`taskpoint.checkpoint._save.Saver` (one commit), multi-writer commits by
:mod:`taskpoint.distributed._parts`, loads by :class:`taskpoint.checkpoint._load.Loader`,
the attempt and its run records by :class:`taskpoint.format.history.Attempt`, listing,
verifying, pruning and collecting by :class:`taskpoint.format._catalog.Catalog`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Union

from taskpoint.checkpoint import _uploader
from taskpoint.checkpoint._load import Loader, Loading
from taskpoint.checkpoint._multiwriter import MultiWriter
from taskpoint.checkpoint._records import Records
from taskpoint.checkpoint._save import (
    Saver,
    Saves,
    Snapshot,
    WhenBusy,
    check_when_busy,
    take_snapshot,
)
from taskpoint.checkpoint._stored import Stored
from taskpoint.errors import CheckpointError
from taskpoint.format import archive, history
from taskpoint.format._catalog import Catalog
from taskpoint.format._digest import Progress
from taskpoint.format._statcache import StatCache
from taskpoint.format.history import SaveStats
from taskpoint.format.manifest import FORMAT_VERSION, TREE_FORMAT, Codec
from taskpoint.store.store import RetryPolicy, Store, absolute_location, check_location

__all__ = ["Checkpoint", "SaveInput", "latest_checkpoint", "stores_by_content"]

log = logging.getLogger(__name__)

SaveInput = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]"]
"""What ``save`` accepts: raw bytes, or the path of a file or directory."""


class Checkpoint(Loading, MultiWriter, Records, Stored):
    """A checkpoint location: ``save`` commits new state, ``load`` restores the newest.

    Args:
        url: where checkpoints live: a local path or any fsspec URL (``s3://b/p``,
            ``gs://b/p``, ``az://c/p``, ``memory://p``, ``file:///p``). A relative local
            path is made absolute against the working directory at construction
            (:attr:`url` then gives the absolute one).
        attempt: the attempt number this process saves as. ``None`` claims the next
            free number from the store at the first save, so two restarts never share one.
        keep: how many committed checkpoints to keep (newest first); at least 1.
        codec: how directories are compressed: ``"gzip"``, ``"zstd"`` or ``"none"``.
        storage_options: passed to the fsspec filesystem (credentials, endpoints).
        workdir: local folder that ``load`` restores into; by default a
            ``taskpoint-restore-*`` folder of the temporary directory, removed at interpreter
            exit, or by a later load of any process once this one has died without exiting
            (SIGKILL).
        retry: how store calls retry transient failures.
        progress: called with the number of payload bytes moved, as saves and loads stream.
        background_upload: where background saves upload: ``"process"`` (a separate
            upload process, so the upload's Python work never holds the training loop's
            GIL) or ``"thread"`` (a thread of this process). One upload process serves
            every ``Checkpoint`` of this Python process; the first background save starts
            it and never waits for it: until it is ready, background saves upload from a
            thread, so the first save is committed one upload later, however slowly the
            process starts. ``memory://`` stores and checkpoints with a ``progress``
            callback always use a thread.

        store_format: how directories are stored: ``2`` (the default) stores each file
            once by content, so a save uploads only what changed and a load into an
            existing folder fetches only what is missing; ``1`` stores one tar archive per
            checkpoint, which any ``tar xzf`` reads (and taskpoint before 0.2).
        when_busy: what a background save asked for while an earlier one still uploads
            does. ``"coalesce"`` (the default; ``TASKPOINT_WHEN_BUSY`` sets it where the
            argument is not given): it returns at once and waits behind the upload in
            flight, which is never interrupted; at most one save waits so, and a newer one
            replaces it (the newest wins). A replaced save is never uploaded; it is
            *coalesced*, and the next commit's :attr:`SaveStats.coalesced` counts it. Each
            waiting save holds the snapshot taken when it was asked for, so what commits is
            the state at that call. A save training waits for goes first: a blocking save
            (and, in the adapters, a preemption save) replaces the waiting one too and
            stops the upload in flight, which ends uncommitted at its next pack object
            (a format-2 tree's; a single file or bytes finishes its upload) and is counted
            as coalesced; it then commits at once. So does a background save waiting
            behind the upload when training waits for the saves (:meth:`wait`,
            :meth:`close`, the interpreter's exit; not after a preemption signal): the
            upload in flight stops, and the newer save uploads at once. ``"wait"``: the
            call first waits for the saves in flight (and raises what a failed one
            raised), so every save is uploaded, in order, and training waits while the
            store is slower than the saves.

    Background uploads run at the priority ``TASKPOINT_UPLOAD_NICE`` sets: a nice
    increment from 0 (the default: the training loop's priority, so a background save
    commits about as fast as a blocking one) to 19. Blocking saves and saves made after a
    preemption signal are never niced: training waits for them.

    :meth:`close` (or the end of a ``with Checkpoint(url) as ckpt:`` block) waits for the
    background saves and ends saving through the object. Neither is needed to free
    anything: a ``Checkpoint`` holds no process or thread of its own once its background
    saves have committed; the upload process it shares with this process's other
    checkpoints ends 10 seconds after the last of them using it was closed or collected,
    or at once after the last let go of it with :meth:`release` (which keeps it open).
    At interpreter exit (an exit on an uncaught exception too)
    every background save still queued or in flight is waited for, up to
    :data:`taskpoint.checkpoint.mirror.EXIT_WAIT_S` seconds in all.

    A ``Checkpoint`` can be pickled and deep-copied (a framework handing its callbacks to
    spawned worker processes does both): the copy is a new, open ``Checkpoint`` with the
    same arguments and attempt number, equal to the original, with its own upload thread.
    Copying first waits for the background saves in flight or queued. A copy
    continues the original's attempt, so save through one of them at a time (as a
    spawned worker and its idle parent do). A ``progress`` callback must be picklable too.

    Raises:
        ValueError: ``url`` is blank, ``keep`` is below 1, ``attempt`` is negative,
            ``codec``, ``background_upload`` or ``when_busy`` (or ``TASKPOINT_WHEN_BUSY``)
            is unknown, or ``store_format`` is neither 1 nor 2.
        TypeError: ``url`` is not a string or path.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        attempt: int | None = None,
        keep: int = 1,
        codec: str = "gzip",
        storage_options: Mapping[str, Any] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        retry: RetryPolicy | None = None,
        progress: Progress | None = None,
        background_upload: str = "process",
        store_format: int = FORMAT_VERSION,
        when_busy: WhenBusy | None = None,
    ) -> None:
        # the upload process, started earlier, may have another working directory
        url = absolute_location(check_location("url", url))
        busy = check_when_busy(when_busy)
        if store_format not in (1, TREE_FORMAT) or isinstance(store_format, bool):
            raise ValueError(f"store_format must be 1 or {TREE_FORMAT}; got {store_format!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int of at least 1; got {keep!r}")
        if attempt is not None and (not isinstance(attempt, int) or attempt < 0):
            raise ValueError(f"attempt must be a non-negative int or None; got {attempt!r}")
        self._codec: Codec = archive.check_codec(codec)
        if background_upload not in ("process", "thread"):
            raise ValueError(
                f'background_upload must be "process" or "thread"; got {background_upload!r}'
            )
        self._config: dict[str, Any] = {
            "url": url, "keep": keep, "codec": codec,
            "storage_options": dict(storage_options or {}),
            "workdir": None if workdir is None else os.fspath(workdir), "retry": retry,
            "progress": progress, "background_upload": background_upload,
            "store_format": store_format, "when_busy": when_busy,
        }
        self._store = Store(url, storage_options, retry)
        self._keep = keep
        self._progress = progress
        self._catalog = Catalog(self._store, progress)
        self._attempt = history.Attempt(self._store, attempt)
        seen = StatCache()  # files this checkpoint saved or restored, by stat
        self._saves = Saves(
            Saver(
                self._catalog, codec=self._codec, store_format=store_format, keep=keep,
                progress=progress, seen=seen,
            ),
            self._catalog,
            self._attempt,
            destination=_uploader.Destination(
                url=url, storage_options=dict(storage_options or {}), retry=retry,
                codec=codec, store_format=store_format, keep=keep,
            ),
            background_upload=background_upload,
            when_busy=busy,
        )
        self._saves.on_commit(self._attempt.committed)  # the end record's totals
        self._loader = Loader(
            self._catalog, Path(workdir) if workdir is not None else None, progress, seen
        )

    @classmethod
    def at(cls, url: str | os.PathLike[str], **options: Any) -> Checkpoint:
        """Bind a checkpoint to ``url`` explicitly, outside any taskpoint task.

        Same arguments as the constructor. Useful inside another orchestrator's task
        (a Flyte task, a Kubernetes Job) that retries on its own: each process claims a new
        attempt number from the store and resumes from the newest committed checkpoint.
        As a job binds its checkpoint when it starts, an object store's client library is
        loaded and its client built on a thread from here on, while the job sets up,
        rather than in its first load or save.
        """
        checkpoint = cls(url, **options)
        checkpoint._store.warm()
        return checkpoint

    # -- copies: a checkpoint travels as its configuration -------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What a pickled or deep-copied checkpoint carries: its constructor arguments and
        its attempt number; the copy makes its own locks, upload thread and upload process.

        Waits first for the background saves in flight or queued to commit, so the copy
        starts from what the store holds and no save is left behind uncommitted.

        Raises:
            CheckpointError: what a failed background save raised (as :meth:`wait` does).
        """
        self._saves.wait()
        return {**self._config, "attempt": self._attempt.number}

    def __setstate__(self, state: dict[str, Any]) -> None:
        Checkpoint.__init__(self, **state)

    def __eq__(self, other: object) -> bool:
        """Equal when both are of one type, address one URL with the same options and save
        as the same attempt (a copy made by ``pickle`` or ``copy.deepcopy`` is equal)."""
        if not isinstance(other, Checkpoint) or type(other) is not type(self):
            return NotImplemented
        return bool(
            self._config == other._config and self._attempt.number == other._attempt.number
        )

    def __hash__(self) -> int:
        return hash((type(self), self._store.url))

    def __repr__(self) -> str:
        return (
            f"Checkpoint({self._store.url!r}, attempt={self._attempt.number!r}, keep={self._keep})"
        )

    @property
    def url(self) -> str:
        """The checkpoint location's URL."""
        return self._store.url

    @property
    def when_busy(self) -> WhenBusy:
        """What a background save asked for during an upload does: ``"coalesce"`` or
        ``"wait"`` (see the class docstring)."""
        return self._saves.when_busy

    @property
    def attempt(self) -> int | None:
        """The attempt number saves are made as; ``None`` until claimed from the store."""
        return self._attempt.number

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the background saves queued or in flight to commit, then take no more.

        The newest committed is the newest asked for: as in :meth:`wait`, an upload in
        flight with a newer save waiting behind it stops for that one (under
        ``when_busy="coalesce"``); otherwise it commits. Afterwards every save
        (``save_sync``, ``save``, ``save_part_sync``, ``begin_parts``, ``upload_part``) raises
        :class:`~taskpoint.CheckpointClosedError`; loading and the other reads still work.
        A second call does nothing. Closing is optional: dropping a ``Checkpoint`` leaks
        nothing (see the class docstring).

        Raises:
            CheckpointError: what the last failed background save raised (as :meth:`wait`
                does); the checkpoint is closed all the same.
        """
        self._saves.close()

    def release(self) -> None:
        """Let go of what saving holds in this process without closing: the checkpoint
        stays open, and its next background save (or a load, which readies saving) takes
        it up again, transparently.

        What it lets go of is its share of the upload process (see ``background_upload``):
        once no other open checkpoint uses that process, it ends now, or, with a save
        still in flight, as soon as that save is answered, and its reader thread with it
        (the upload thread of each checkpoint ends on its own once its saves are done).
        So after a fit's last save has committed, nothing of taskpoint's runs on; the
        framework adapters call it when training ends. Saves begun before it still commit.
        Never waits: call :meth:`wait` first to have the saves committed. Does nothing on
        a closed checkpoint.
        """
        self._saves.release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._saves.closed

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """:meth:`close`; a failed background save is raised, unless the block itself
        raised (it is logged then, and the block's exception goes on)."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as error:
            log.warning("a background save to %s failed: %s", self.url, error)

    # -- saving -----------------------------------------------------------------------

    def save_sync(
        self, data: SaveInput, *, background: bool = False, snapshot: Snapshot = "copy"
    ) -> None:
        """Commit ``data`` as the newest checkpoint.

        Args:
            data: raw bytes (bytes, bytearray, memoryview), or the path (str or
                os.PathLike) of a file, stored as-is, or of a directory, stored as one
                compressed tar archive.
            background: snapshot ``data`` (a local copy of the file or tree) and return;
                the upload runs in the background (see ``background_upload``). Changing
                the file or tree afterwards cannot change the checkpoint. Asked for while
                an earlier background save still uploads, it waits behind that upload,
                replacing (coalescing) a save already waiting there, or, with
                ``when_busy="wait"``, first waits for the upload. A newer save supersedes
                a background save still waiting. Its errors are raised by the next save,
                by :meth:`wait` or by :meth:`close`.
            snapshot: how a background save snapshots a path. ``"copy"`` copies it;
                ``"link"`` hard-links its files where the disk allows (copying the rest),
                which is instant but only safe for files that are replaced or deleted,
                never rewritten in place (what the Trainer and Lightning do with finished
                checkpoints; ``torch.save`` over an existing path rewrites it in place): a
                linked file rewritten before the upload has read it fails the save with
                :class:`CheckpointSaveError` rather than storing content not the snapshot's.

        Concurrent saves on one ``Checkpoint`` run one at a time; the one started last
        is the newest once all have returned.

        Raises:
            TypeError: ``data`` is of another type.
            ValueError: ``snapshot`` is neither ``"copy"`` nor ``"link"``.
            FileNotFoundError: the path does not exist.
            CheckpointUnsafeError: the directory holds a special file or a link leaving it.
            CheckpointStoreError: the store failed (this save's, or an earlier background
                save's); earlier checkpoints are untouched.
            CheckpointSaveError: a file of ``data`` could not be read (or snapshotted),
                or taskpoint failed; nothing was committed.
            CheckpointClosedError: :meth:`close` was called.
        """
        source, ticket = self._saves.begin(data, snapshot, background)
        if background:
            self._saves.queue(take_snapshot(source, snapshot), ticket)
        else:
            self._saves.run(source, ticket)

    async def save(
        self, data: SaveInput, *, background: bool = False, snapshot: Snapshot = "copy"
    ) -> None:
        """Async :meth:`save_sync`: the snapshot and upload run in worker threads."""
        source, ticket = self._saves.begin(data, snapshot, background)
        if background:
            self._saves.queue(await asyncio.to_thread(take_snapshot, source, snapshot), ticket)
        else:
            await asyncio.to_thread(self._saves.run, source, ticket)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until background saves have committed.

        Under ``when_busy="coalesce"`` the newest goes first: a save waiting behind the
        upload in flight stops that upload, which ends uncommitted (counted as coalesced),
        and uploads at once instead of after it. Under ``"wait"`` every save commits, in
        order.

        Args:
            timeout: give up after this many seconds (``None``: no limit). A save given
                up on goes on uploading; until it commits, the newest checkpoint is the
                one before it.

        Returns:
            ``True`` once no background save is queued or running; ``False`` when
            ``timeout`` ran out first.

        Raises:
            CheckpointError: what the last failed background save raised.
        """
        return self._saves.wait(timeout)

    def on_commit(self, callback: Callable[[SaveStats], object]) -> Callable[[SaveStats], object]:
        """Call ``callback`` with a :class:`~taskpoint.SaveStats` after each commit.

        It runs in the thread that committed: the caller's for blocking saves, the upload
        thread for background ones; what it raises is logged, never raised into a save.
        Usable as a decorator; returns ``callback``.
        """
        self._saves.on_commit(callback)
        return callback


def latest_checkpoint(
    root: str | os.PathLike[str] | None,
    glob_pattern: str = "**/last.ckpt",
    key: Callable[[Path], Any] | None = None,
) -> Path | None:
    """The newest file under ``root`` matching ``glob_pattern``, or ``None``.

    Args:
        root: a restored directory (what ``load`` returned). ``None`` or a missing path
            gives ``None``. A file is returned itself when its name matches the pattern's
            last part.
        glob_pattern: a :meth:`pathlib.Path.glob` pattern relative to ``root``.
        key: orders the matches; the largest wins. Defaults to the modification time
            (following symbolic links), then the path.
    """
    if root is None:
        return None
    base = Path(os.fspath(root))
    if base.is_file():
        return base if base.match(glob_pattern.rsplit("/", 1)[-1]) else None
    if not base.is_dir():
        return None
    matches = [p for p in base.glob(glob_pattern) if p.is_file()]
    if not matches:
        return None
    order = key or (lambda p: (p.stat().st_mtime_ns, str(p)))
    return max(matches, key=order)


def stores_by_content(checkpoint: object) -> bool:
    """Whether ``checkpoint`` is a :class:`Checkpoint` that stores folders by content (store
    format 2, the default): a save of a folder uploads only the files, and the chunks of
    files, that changed since the last save, so an adapter hands it the folder holding its
    bundle rather than the bundle file.

    Returns:
        ``True`` for a :class:`Checkpoint` made with ``store_format=2``; ``False`` for one
        with ``store_format=1`` (one archive per save) and for any other
        :class:`~taskpoint.CheckpointLike` (another system's checkpoint object).
    """
    if not isinstance(checkpoint, Checkpoint):
        return False
    return bool(checkpoint._config.get("store_format", TREE_FORMAT) == TREE_FORMAT)

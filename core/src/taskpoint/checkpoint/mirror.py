r"""``FolderMirror``: upload a finished local folder without stopping training for the store.

For the framework adapters (``taskpoint_hf``, ``taskpoint_lightning``), whose frameworks
write a checkpoint folder and then never rewrite a finished checkpoint in it, only delete
old ones. Once the folder is complete the adapter calls :meth:`FolderMirror.save`, which
raises an earlier upload's error, takes a snapshot later writes cannot change, starts
uploading it (or, while an upload runs, leaves it waiting behind that one) and returns::

    mirror = FolderMirror(checkpoint)          # any CheckpointLike
    mirror.save(output_dir, step=step)         # in the framework's save hook
    for stats in mirror.take_stats():          # at a later hook, in the training thread
        log_metrics(stats.metrics())
    mirror.wait()                              # at the end of training

The snapshot hard-links the folder's files where the disk allows (copying the rest): the
framework must replace or delete files, never rewrite one in place, while an upload runs.
On a :class:`~taskpoint.Checkpoint` the snapshot and upload are
``save_sync(folder, background=True, snapshot="link")``'s (on another object with a
``wait`` method, ``save_sync(folder, background=True)``'s); on another checkpoint object
(Flyte's) the mirror takes the same snapshot and calls ``save_sync`` from its own upload
thread. ``blocking=True`` uploads in :meth:`FolderMirror.save` itself. At most one upload is in
flight and at most one save waits behind it; a newer save replaces the one waiting (it is
coalesced, and counted in :attr:`MirrorStats.coalesced`), unless the checkpoint's
``when_busy`` is ``"wait"``: then each save waits for the upload before it, and every one
is uploaded, in order.

Every mirror (and whatever else an adapter passes to :func:`~taskpoint.integration.track`,
and every checkpoint's background saves) is known to
:func:`~taskpoint.integration.settle_uploads`, which the adapters' restore functions call
first: a retry in the same process never loads the store while the
failed attempt's last upload still runs. At interpreter exit, an exit on an uncaught
exception included, the uploads in flight are waited for, up to :data:`EXIT_WAIT_S`
seconds in all, before the interpreter's thread pools shut down (see
:mod:`taskpoint.checkpoint._settle`).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from taskpoint import preemption
from taskpoint._types import CheckpointLike
from taskpoint.checkpoint import _inflight
from taskpoint.checkpoint._save import Source, classify, discard, take_snapshot
from taskpoint.checkpoint._settle import EXIT_WAIT_S, track
from taskpoint.checkpoint._upload_thread import UploadThread
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.distributed.coordination import Coordinator
from taskpoint.format.history import SaveStats
from taskpoint.progress import current_step

__all__ = [
    "EXIT_WAIT_S", "FolderMirror", "MirrorStats", "combined_metrics", "note_coalesced",
    "unshare", "uploads_in_flight",
]

log = logging.getLogger(__name__)

PREFIX = "taskpoint/"
"""The prefix of every metric name the adapters log."""


def uploads_in_flight(url: str | None = None) -> bool:
    """Whether a process on this machine is still committing a save to ``url`` (``None``:
    to any location): the upload process of an attempt that died goes on to commit the
    save it was given.

    :meth:`taskpoint.Checkpoint.load_sync` waits for such uploads first, at most the grace
    period; one still running after that may yet commit a checkpoint newer than the one
    restored, so a restore keeps the local files of such a checkpoint rather than delete
    them.
    """
    return bool(_inflight.in_flight(url))


def unshare(path: str | os.PathLike[str], *, copy: bool = True) -> int:
    """Give each regular file at or under ``path`` that has other hard links (a snapshot's)
    a copy of its own, renamed over it, so writing over it in place later leaves the other
    links' content alone.

    For a folder a framework is about to rewrite in place while the snapshot an upload
    reads still shares its files (a resumed run writing a ``checkpoint-N`` again): such a
    snapshot refuses to commit a file changed under it. The content, mode and times stay.

    Args:
        path: a file or a folder.
        copy: ``False`` removes each linked file instead of copying it, for files the
            caller is about to write anew, whole (a framework saving ``last.ckpt`` again):
            the write then makes a new file, without the cost of a copy. The other links
            keep the content either way.

    Returns:
        How many files were copied (or removed; 0 when ``path`` does not exist).

    Raises:
        OSError: a copy could not be written (the file keeps its links then).
    """
    root = Path(os.fspath(path))
    if not root.exists():
        return 0
    files = [root] if not root.is_dir() else [
        Path(folder, name) for folder, _, names in os.walk(root) for name in names
    ]
    copied = 0
    for file in files:
        info = file.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_nlink < 2:
            continue
        if not copy:
            file.unlink()
            copied += 1
            continue
        handle, temp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
        os.close(handle)
        try:
            shutil.copy2(file, temp)
            os.replace(temp, file)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        copied += 1
    return copied


def note_coalesced(checkpoint: object, count: int = 1) -> None:
    """Tell ``checkpoint`` that an adapter replaced ``count`` background saves of it before
    they reached it (on the adapter's own :class:`~taskpoint.integration.UploadThread`):
    its next commit counts them in :attr:`taskpoint.SaveStats.coalesced`. Nothing for
    another checkpoint object."""
    if isinstance(checkpoint, Checkpoint):
        checkpoint._saves.note_coalesced(count)


def make_way(checkpoint: object) -> None:
    """Clear ``checkpoint``'s background saves out of the way of a save training is about
    to wait for (a preemption save), which holds newer state: the one waiting is dropped
    and the one uploading stops, uncommitted; the next commit counts both as coalesced.
    Only under ``when_busy="coalesce"``; nothing for another checkpoint object."""
    if isinstance(checkpoint, Checkpoint) and checkpoint.when_busy == "coalesce":
        checkpoint._saves.make_way()


@dataclass(frozen=True)
class MirrorStats:
    """What one mirrored save cost.

    Attributes:
        step: the training step the adapter saved at, when it gave one.
        blocked_s: how long the save hook held training up (waiting for the previous
            upload, the snapshot; the whole upload when blocking).
        upload_s: payload and manifest write time; the whole ``save_sync`` call when the
            checkpoint reports no figures of its own. ``None`` when unknown.
        uploaded_bytes: bytes sent to the store, when the checkpoint reports them.
        stored_bytes: the stored payload's size, when the checkpoint reports it.
        background: whether the upload ran while training went on.
        coalesced: how many saves asked for before this one (since the previous commit)
            were replaced while they waited behind an upload, and never uploaded.
    """

    step: int | None
    blocked_s: float
    upload_s: float | None
    uploaded_bytes: int | None
    stored_bytes: int | None
    background: bool
    coalesced: int = 0

    def metrics(self) -> dict[str, float]:
        """The figures known, as ``taskpoint/<name>`` metrics."""
        out = combined_metrics([self])
        del out[f"{PREFIX}saves"]
        return out


def combined_metrics(stats: Sequence[MirrorStats]) -> dict[str, float]:
    """``taskpoint/*`` metrics for ``stats`` (one or more saves reported together).

    Times, uploaded bytes and coalesced saves (``taskpoint/coalesced``, only when some
    were) are summed; ``stored_bytes`` is the newest save's; ``taskpoint/saves`` says how
    many saves the figures cover. Empty for no saves.
    """
    if not stats:
        return {}
    out: dict[str, float] = {
        f"{PREFIX}blocked_s": sum(s.blocked_s for s in stats),
        f"{PREFIX}saves": float(len(stats)),
    }
    upload = [s.upload_s for s in stats if s.upload_s is not None]
    if upload:
        out[f"{PREFIX}upload_s"] = sum(upload)
    uploaded = [s.uploaded_bytes for s in stats if s.uploaded_bytes is not None]
    if uploaded:
        out[f"{PREFIX}uploaded_bytes"] = float(sum(uploaded))
    stored = [s.stored_bytes for s in stats if s.stored_bytes is not None]
    if stored:
        out[f"{PREFIX}stored_bytes"] = float(stored[-1])
    coalesced = sum(s.coalesced for s in stats)
    if coalesced:
        out[f"{PREFIX}coalesced"] = float(coalesced)
    return out


@dataclass
class _Save:
    """One mirrored save, until its figures are all known."""

    step: int | None
    background: bool
    started: float
    blocked_s: float | None = None
    upload_s: float | None = None
    commit: SaveStats | None = None  # what the checkpoint reported, if it does
    committed: bool = False
    reported: bool = False
    part: bool = False  # a multi-writer save, run by the mirror's own thread
    coalesced: int = 0  # saves replaced before this one, never uploaded


class FolderMirror:
    """Mirror a local folder to ``checkpoint``, one background upload at a time.

    Args:
        checkpoint: a :class:`~taskpoint.Checkpoint` or any :class:`~taskpoint.CheckpointLike`.
            Its ``wait`` (if any) is used for background saves and ``on_commit`` (if any)
            for the upload figures; without them the mirror uploads from its own thread
            and measures what it can.
        blocking: upload inside :meth:`save`, as a plain ``save_sync`` call. ``None``: in
            the background for a :class:`~taskpoint.Checkpoint` (its task waits for the
            upload at the attempt's end), blocking for any other checkpoint, whose owner
            (Flyte, say) may end the attempt and hand the checkpoint on before a background
            upload lands.

    A save asked for while an upload runs does not wait for it (unless the checkpoint's
    ``when_busy`` is ``"wait"``, or the checkpoint is another object with a ``wait`` of its
    own): its snapshot, taken at the call, waits behind the upload, and a newer save
    replaces it there (it is coalesced: never uploaded, and counted in the next
    :class:`MirrorStats`). So what commits is always a folder as it was when a save was
    asked for, and the newest one asked for commits next.

    Meant for a checkpoint the mirror has to itself: the figures of each commit the
    checkpoint reports are taken as those of the oldest save in flight.
    """

    def __init__(self, checkpoint: CheckpointLike, *, blocking: bool | None = None) -> None:
        self._checkpoint = checkpoint
        self._blocking = not isinstance(checkpoint, Checkpoint) if blocking is None else blocking
        self._native: Callable[[], None] | None = getattr(checkpoint, "wait", None)
        if not callable(self._native):
            self._native = None
        self._cond = threading.Condition()
        self._flight: list[_Save] = []  # saves not yet committed, oldest first
        self._reports: list[MirrorStats] = []
        self._worker = UploadThread("taskpoint-mirror-upload")
        self._waiter: tuple[threading.Thread, list[BaseException]] | None = None
        on_commit = getattr(checkpoint, "on_commit", None)
        self._reports_commits = callable(on_commit)
        if callable(on_commit):
            on_commit(self._on_commit)
        track(self)

    @property
    def blocking(self) -> bool:
        """Whether :meth:`save` uploads before it returns."""
        return self._blocking

    @property
    def uploading(self) -> bool:
        """Whether an upload may still be running (until :meth:`wait` returns)."""
        with self._cond:
            return bool(self._flight)

    @property
    def coalesces(self) -> bool:
        """Whether a background save asked for during an upload replaces the one waiting
        behind it rather than wait (see the class docstring)."""
        if self._blocking:
            return False
        if isinstance(self._checkpoint, Checkpoint):
            return self._checkpoint.when_busy == "coalesce"
        return self._native is None  # another object's own background saves are waited for

    def save(self, folder: str | Path, *, step: int | None = None) -> None:
        """Start mirroring ``folder``, as it is now, and return.

        An upload still running is never waited for when the mirror :attr:`coalesces`:
        this save's snapshot waits behind it (replacing one waiting there). Otherwise it
        waits first for the previous upload.

        Raises:
            CheckpointError: an earlier upload failed (this folder is not saved then;
                the store keeps the checkpoint before), or, when blocking, this one did.
            FileNotFoundError: ``folder`` does not exist.
        """
        started = time.monotonic()
        if self.coalesces:
            self._raise_failed()
        else:
            self.wait()
        record = _Save(step, background=not self._blocking, started=started)

        def start() -> None:
            if self._blocking:
                self._checkpoint.save_sync(folder)
                upload_s = time.monotonic() - started
                with self._cond:
                    record.upload_s = upload_s
                    record.committed = True
            elif isinstance(self._checkpoint, Checkpoint):
                self._checkpoint.save_sync(folder, background=True, snapshot="link")
            elif self._native is not None:  # another object with taskpoint's wait()
                self._checkpoint.save_sync(folder, background=True)  # type: ignore[call-arg]
            else:
                source = take_snapshot(classify(folder, started), "link")
                self._worker.start(
                    lambda: self._upload(record, source),
                    on_drop=lambda: self._drop(record, source),
                )

        self._record(record, start)

    def save_part(
        self,
        part: Path,
        *,
        coordinator: Coordinator,
        step: int | None = None,
        remove: Path | None = None,
    ) -> None:
        """Commit ``part`` with every other rank's, through
        :meth:`taskpoint.Checkpoint.save_part_sync`, then remove ``remove`` (by default
        ``part`` itself).

        ``part`` must be a folder nothing else writes (a staging folder of hard links, see
        :func:`taskpoint.distributed.nodes.stage_part`): it is the snapshot. Every rank of
        ``coordinator`` calls this once per save, in the same order. In the background the
        protocol's collectives run in the mirror's thread, so ``coordinator`` must be one
        no other thread uses while it runs (a :class:`~taskpoint.StoreCoordinator`, or a
        ``TorchCoordinator`` of its own). Waits first for the previous upload. The manifest
        names ``step`` (by default the step last reported) and whether a preemption notice
        was held as of this call, not as of the commit.

        Raises:
            TypeError: the mirror's checkpoint is not a :class:`~taskpoint.Checkpoint`.
            CheckpointError: the previous upload failed, or, when blocking, this one did
                (on every rank: a failed rank fails the save everywhere).
        """
        checkpoint = self._checkpoint
        remove = part if remove is None else remove
        if not isinstance(checkpoint, Checkpoint):
            shutil.rmtree(remove, ignore_errors=True)
            raise TypeError(
                "a checkpoint written by several processes needs a taskpoint.Checkpoint; "
                f"got {type(checkpoint).__name__}"
            )
        started = time.monotonic()
        try:
            self.wait()
        except BaseException:
            shutil.rmtree(remove, ignore_errors=True)
            raise
        record = _Save(step, background=not self._blocking, started=started, part=True)
        at = current_step() if step is None else step  # as of this call, not the upload's
        noticed = preemption.requested()

        def job() -> None:
            began = time.monotonic()
            try:
                checkpoint.save_part_sync(
                    part, coordinator=coordinator, step=at, noticed=noticed
                )
            finally:
                shutil.rmtree(remove, ignore_errors=True)
            with self._cond:
                record.upload_s = time.monotonic() - began

        def start() -> None:
            if self._blocking:
                job()
                with self._cond:
                    record.committed = True
            else:
                self._worker.start(job)

        self._record(record, start)

    def _record(self, record: _Save, start: Callable[[], None]) -> None:
        """Make ``record`` the newest save in flight while ``start`` runs it (to the commit
        when blocking, else until its upload is queued), then report how long the caller
        was blocked; a save that fails to start is no longer in flight."""
        with self._cond:
            self._flight.append(record)
        try:
            start()
        except BaseException:
            with self._cond:
                if record in self._flight:
                    self._flight.remove(record)
            raise
        with self._cond:
            record.blocked_s = time.monotonic() - record.started
            self._report(record)
            if self._blocking and record in self._flight:
                self._flight.remove(record)

    def _raise_failed(self) -> None:
        """Raise what a finished upload raised, without waiting for one in flight; the
        oldest save in flight is then taken as the one that failed."""
        try:
            if isinstance(self._checkpoint, Checkpoint):
                self._checkpoint._saves.raise_error()
            else:
                self._worker.raise_error()
        except BaseException:
            with self._cond:
                pending = [r for r in self._flight if not r.committed]
                if pending:
                    self._flight.remove(pending[0])
            raise

    def drop_waiting(self) -> bool:
        """Drop the save waiting behind the upload in flight, if any: it is coalesced
        (counted by the next commit's figures) and never uploaded. For a preemption save
        about to be made of the same folder, newer, which goes first instead; the upload
        in flight goes on.

        Returns:
            Whether a save was waiting.
        """
        if isinstance(self._checkpoint, Checkpoint):
            return self._checkpoint._saves.drop_waiting()
        return self._worker.drop_pending()  # its on_drop removes the record

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the uploads in flight (and the one waiting) have committed.

        Args:
            timeout: give up after this many seconds (``None``: no limit).

        Returns:
            ``True`` once no upload is running; ``False`` when ``timeout`` ran out first.

        Raises:
            CheckpointError: what an upload raised (raised once).
        """
        with self._cond:
            if not self._flight:
                return True
            part = any(r.part for r in self._flight)
        try:
            done = (
                self._wait_native(timeout) if self._native is not None and not part
                else self._worker.wait(timeout)
            )
        except BaseException:
            with self._cond:
                self._flight.clear()
            raise
        if not done:
            return False
        with self._cond:
            for record in self._flight:
                if not record.committed and not self._reports_commits:
                    record.committed = True  # the checkpoint reported no figures for it
                    self._report(record)
            # Left uncommitted by a checkpoint that reports its commits: coalesced, and
            # counted by the commit that replaced it.
            self._flight.clear()
        return True

    def take_stats(self) -> list[MirrorStats]:
        """The figures of the saves committed since the last call, oldest first."""
        with self._cond:
            reports, self._reports = self._reports, []
        return reports

    # -- internals --------------------------------------------------------------------

    def _wait_native(self, timeout: float | None) -> bool:
        """``checkpoint.wait()``, given up after ``timeout`` seconds.

        ``wait`` takes no timeout, so it runs in a helper thread; one that outlives its
        timeout is joined again by the next call, so the error it catches is not lost.
        """
        with self._cond:
            if self._waiter is None:
                box: list[BaseException] = []
                waiter = threading.Thread(
                    target=self._run_wait, args=(box,), name="taskpoint-mirror-wait",
                    daemon=True,
                )
                self._waiter = (waiter, box)
                waiter.start()
            waiter, box = self._waiter
        waiter.join(timeout)
        if waiter.is_alive():
            return False
        with self._cond:
            self._waiter = None
        if box:
            raise box[0]
        return True

    def _run_wait(self, box: list[BaseException]) -> None:
        try:
            assert self._native is not None
            self._native()
        except BaseException as exc:  # handed to the thread that waits
            box.append(exc)

    def _upload(self, record: _Save, source: Source) -> None:
        started = time.monotonic()
        with self._cond:  # the saves this one replaced while it waited
            record.coalesced += self._worker.replaced
        try:
            assert source.path is not None
            self._checkpoint.save_sync(source.path)
        finally:
            discard(source)
        with self._cond:
            record.upload_s = time.monotonic() - started
            if not self._reports_commits:
                record.committed = True
                if record in self._flight:
                    self._flight.remove(record)
            self._report(record)

    def _drop(self, record: _Save, source: Source) -> None:
        """A newer save replaced ``record`` before its upload started (on the mirror's own
        thread): it is coalesced, and counted by the save that runs next."""
        discard(source)
        with self._cond:
            if record in self._flight:
                self._flight.remove(record)

    def _on_commit(self, stats: SaveStats) -> None:
        with self._cond:
            waiting = [r for r in self._flight if not r.committed]
            # The checkpoint replaced the oldest ones, which waited behind an upload.
            for dropped in waiting[: stats.coalesced]:
                self._flight.remove(dropped)
            waiting = waiting[stats.coalesced :]
            if not waiting:
                return  # a commit that is not the mirror's
            record = waiting[0]
            record.commit = stats
            record.committed = True
            record.coalesced += stats.coalesced
            if not record.part:
                self._flight.remove(record)
            self._report(record)

    def _report(self, record: _Save) -> None:
        """Queue ``record``'s figures once they are all known (with ``_cond`` held)."""
        if record.reported or not record.committed or record.blocked_s is None:
            return
        commit = record.commit
        self._reports.append(
            MirrorStats(
                step=record.step,
                blocked_s=record.blocked_s,
                upload_s=commit.upload_s if commit is not None else record.upload_s,
                uploaded_bytes=commit.uploaded if commit is not None else None,
                stored_bytes=commit.size if commit is not None else None,
                background=record.background,
                coalesced=record.coalesced,
            )
        )
        record.reported = True

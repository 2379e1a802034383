"""The load path: find the newest intact checkpoint and restore it to local disk.

:class:`Loading` gives :class:`~taskpoint.Checkpoint` ``load_sync`` and ``load``: they
check the request, wait for an upload to the location still in flight on this machine,
let the :class:`Loader` find and fetch the checkpoint, and record the resume in the run's
history (:mod:`taskpoint.format.history`).

:meth:`Loader.load` tries committed checkpoints newest first: one that fails its checksum
or cannot be read back is skipped with a :class:`~taskpoint.TaskpointWarning`; one pruned
while it was read sends the search back to a fresh listing. The format decides
which of two restores runs, both in :mod:`taskpoint.format`: a format-1 payload by
:func:`taskpoint.format._payload.restore_payload`, a format-2 tree by
:func:`taskpoint.format._tree_restore.restore_tree`. A failure of the local disk (full,
read-only, refused) is a :class:`~taskpoint.CheckpointRestoreError`, never taken for a bad
checkpoint (:func:`taskpoint.format._payload.is_local_write_error`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from taskpoint import _scratch
from taskpoint.checkpoint import _inflight
from taskpoint.checkpoint._save import Saves
from taskpoint.errors import (
    CheckpointCoordinationError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointRestoreError,
    CheckpointStoreError,
    CheckpointUnsafeError,
    warn,
)
from taskpoint.format import _payload, _tree_restore, history
from taskpoint.format._catalog import Catalog
from taskpoint.format._digest import Progress
from taskpoint.format._payload import is_local_write_error
from taskpoint.format._statcache import StatCache, now_ns
from taskpoint.format.manifest import CHECKPOINTS, Manifest, check_paths
from taskpoint.store.store import Store

__all__ = ["BYTES_NAME", "Loader", "Loading", "restore_error"]

log = logging.getLogger(__name__)

BYTES_NAME = "checkpoint.bin"
"""The file name a restored bytes payload gets."""

class Loader:
    """Restores checkpoints of one location.

    Args:
        catalog: the location's committed checkpoints (each restored one is recorded
            intact there).
        workdir: the local folder restores go to without ``into``; a temporary folder,
            removed at interpreter exit, when ``None``.
        progress: called with the number of payload bytes moved.
        seen: files known unchanged by their stat, shared with the checkpoint's saver
            (see :mod:`taskpoint.format._statcache`): a restore into a folder trusts those it
            knows, and records every file of a tree it restored.
    """

    def __init__(
        self,
        catalog: Catalog,
        workdir: Path | None = None,
        progress: Progress | None = None,
        seen: StatCache | None = None,
    ) -> None:
        self._seen = seen
        self._catalog = catalog
        self._store = catalog.store
        self._workdir = workdir
        self._progress = progress
        self._loads = itertools.count()

    def load(
        self,
        into: Path | None = None,
        part: int | None = None,
        paths: frozenset[str] | None = None,
    ) -> tuple[Path, Manifest, float] | None:
        """Restore the newest intact committed checkpoint (see :meth:`taskpoint.Checkpoint.load_sync`).

        Returns:
            The restored path, the checkpoint's manifest and the seconds its restore took;
            ``None`` when nothing has been committed.

        Raises:
            CheckpointCorruptError: checkpoints exist but none is intact.
            CheckpointFormatError: the newest manifest comes from a newer format.
            CheckpointUnsafeError: a directory archive holds an unsafe entry.
            CheckpointRestoreError: the local disk refused what the restore wrote.
            CheckpointStoreError: the store failed, or checkpoints kept being replaced.
            CheckpointCoordinationError: the newest checkpoint has no part ``part``, or
                holds none of some of ``paths``.
        """
        for _ in range(5):
            names = self._catalog.names()
            if not names:
                log.info("no checkpoint committed at %s", self._store.url)
                return None
            found, skipped, pruned = self._load_newest(names, into, part, paths)
            if found is not None:
                return found
            if not pruned:
                raise CheckpointCorruptError(
                    f"no intact checkpoint at {self._store.url}: all {len(skipped)} committed "
                    f"checkpoints failed verification ({', '.join(skipped)})",
                    url=self._store.url,
                    skipped=skipped,
                )
            # A writer pruned what we were reading: list again and take its newer commit.
        raise CheckpointStoreError(
            f"checkpoints at {self._store.url} kept being replaced while loading; try again",
            url=self._store.url,
        )


    def _remember(self, manifest: Manifest, root: Path, clock: int) -> None:
        """Record the files of the tree just restored at ``root`` as known unchanged."""
        if self._seen is not None and manifest.is_tree:
            self._seen.record_restored(root, manifest.entries or (), clock)

    def _load_newest(
        self,
        names: list[str],
        into: Path | None = None,
        part: int | None = None,
        paths: frozenset[str] | None = None,
    ) -> tuple[tuple[Path, Manifest, float] | None, list[str], bool]:
        """Restore the newest intact of ``names``; also report skipped and pruned ones.

        A checkpoint without the ``part`` or ``paths`` asked for raises (a
        :class:`CheckpointCoordinationError`): an older one that has them is another save.
        """
        skipped: list[str] = []
        pruned = False
        for name in reversed(names):
            url = self._store.url_of(f"{CHECKPOINTS}/{name}")
            try:
                manifest = self._catalog.read(name)
                started = time.monotonic()
                if part is not None:
                    manifest = manifest.only_part(part, url=url)
                if paths is not None:
                    where = url if part is None else f"{url} (the part of rank {part})"
                    manifest = manifest.only_paths(paths, url=where)
                path = self._restore(manifest, into)
            except (
                CheckpointCoordinationError,
                CheckpointStoreError,
                CheckpointFormatError,
                CheckpointUnsafeError,
                CheckpointRestoreError,
            ):
                raise
            except (CheckpointError, FileNotFoundError) as exc:
                if name not in self._store.list(CHECKPOINTS):
                    pruned = True  # replaced by a newer commit while we read it
                    continue
                skipped.append(url)
                message = f"skipping checkpoint {url}: {exc}"
                warn(log, message, stacklevel=4)  # the caller of load_sync
                continue
            elapsed = time.monotonic() - started
            whole = part is None and paths is None
            log.info(
                "restored %s checkpoint %s (%s%d bytes) in %.2fs",
                manifest.kind, url,
                "" if whole else f"{len(manifest.entries or ())} paths, ", manifest.size,
                elapsed,
            )
            if whole:  # a partial restore checked only the objects its paths use
                self._catalog.intact.add((manifest.key, manifest.checksum))
            return (path, manifest, elapsed), skipped, pruned
        return None, skipped, pruned

    def _restore_dir(self, manifest: Manifest) -> Path:
        try:
            if self._workdir is None:
                self._workdir = _scratch.restore_folder()
            self._workdir.mkdir(parents=True, exist_ok=True)
            while True:  # an earlier process may have restored here under the same name
                target = self._workdir / f"{manifest.attempt:06d}-{manifest.seq:09d}-{next(self._loads)}"
                try:
                    target.mkdir()
                    break
                except FileExistsError:
                    continue
        except OSError as exc:
            where = str(self._workdir or tempfile.gettempdir())
            raise restore_error(exc, where) from exc
        return target

    def _staging_in(self, into: Path) -> Path:
        try:
            into.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=".taskpoint-restore-", dir=into))
        except OSError as exc:
            raise restore_error(exc, str(into)) from exc

    def _restore(self, manifest: Manifest, into: Path | None = None) -> Path:
        clock = now_ns()
        staging = self._restore_dir(manifest) if into is None else self._staging_in(into)
        path = staging / (manifest.name or BYTES_NAME)
        try:
            if manifest.is_tree:
                _tree_restore.restore_tree(
                    self._store, manifest, path, existing=into, progress=self._progress,
                    workers=max(16, self._store.transfer.concurrency), seen=self._seen,
                )
            else:
                _payload.restore_payload(self._store, manifest, path, self._progress)
        except CheckpointStoreError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if exc.__cause__ is not None and is_local_write_error(exc.__cause__, staging):
                raise restore_error(exc.__cause__, str(path)) from exc
            raise
        except FileNotFoundError:  # the payload is missing from the store
            shutil.rmtree(staging, ignore_errors=True)
            raise
        except OSError as exc:  # reading back what was written: the local disk's fault
            shutil.rmtree(staging, ignore_errors=True)
            raise restore_error(exc, str(path)) from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if into is None:
            self._remember(manifest, path, clock)
            return path
        try:
            if manifest.kind == "directory":
                _tree_restore.swap_into(path, into)
                self._remember(manifest, into, clock)
                return into
            os.replace(path, into / path.name)
            return into / path.name
        except OSError as exc:
            raise restore_error(exc, str(into)) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def restore_error(exc: BaseException, path: str) -> CheckpointRestoreError:
    """The error that says writing ``path`` (or the file ``exc`` names) to local disk failed."""
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    where = getattr(exc, "filename", None) or path
    return CheckpointRestoreError(
        f"cannot restore the checkpoint to local disk: writing {where} failed: {cause} "
        f"({type(exc).__name__}). The checkpoint in the store is intact and untouched; "
        "free space or fix the restore directory (workdir=), then load again",
        path=str(where),
    )


_Request = tuple[Path | None, int | None, frozenset[str] | None]
"""What a load asks for: ``into``, ``part`` and ``paths``, checked."""


def _check_request(
    into: str | os.PathLike[str] | None, part: int | None, paths: Collection[str] | None
) -> _Request:
    """``load_sync``'s arguments, checked (see there for the ``ValueError``)."""
    if part is not None and (isinstance(part, bool) or not isinstance(part, int) or part < 0):
        raise ValueError(f"part must be a rank (an int of at least 0) or None; got {part!r}")
    wanted = None if paths is None else check_paths(paths)
    return (None if into is None else Path(os.fspath(into)), part, wanted)


class _Prefetch:
    """A restore running ahead on a daemon thread, until a load takes or drops it."""

    def __init__(
        self,
        request: _Request,
        find: Callable[[_Request], tuple[Path, Manifest, float] | None],
        after: _Prefetch | None = None,
    ) -> None:
        self.request = request
        self._after = after  # a prefetch this one replaces: dropped before it starts
        self._found: tuple[Path, Manifest, float] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(find,), name="taskpoint-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, find: Callable[[_Request], tuple[Path, Manifest, float] | None]) -> None:
        try:
            if self._after is not None:
                self._after.drop()
                self._after = None
            self._found = find(self.request)
        except BaseException as exc:  # handed to the load that takes it
            self._error = exc

    def result(self) -> tuple[Path, Manifest, float] | None:
        """Wait for the restore; what it found, or raise what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._found

    def drop(self) -> None:
        """Wait for the restore and throw away a fresh folder it restored into."""
        self._thread.join()
        if self._found is not None and self.request[0] is None:
            shutil.rmtree(self._found[0].parent, ignore_errors=True)
        if self._error is not None:
            log.debug("a dropped prefetch had failed: %s", self._error)


class Loading:
    """The load methods of :class:`~taskpoint.Checkpoint`, which inherits them.

    It holds no more than the restore :meth:`prefetch` started; otherwise it works
    through the collaborators ``Checkpoint``'s constructor makes (its loader and saves,
    the store, the attempt).
    """

    _store: Store
    _saves: Saves
    _loader: Loader
    _attempt: history.Attempt
    _prefetched: _Prefetch | None = None

    def load_sync(
        self,
        *,
        into: str | os.PathLike[str] | None = None,
        part: int | None = None,
        paths: Collection[str] | None = None,
    ) -> Path | None:
        """Restore the newest intact committed checkpoint to a local path.

        Args:
            into: a local directory to restore into instead of a fresh folder. A directory
                checkpoint's tree *becomes* ``into``: files already there with the right
                size and content are kept rather than downloaded (a retry on the same
                machine fetches only what is missing), the others are replaced, and
                anything the checkpoint does not hold is removed. A file or bytes
                checkpoint is placed in ``into`` under its name. Nothing in ``into``
                changes unless the whole checkpoint restored and verified. With ``part``
                or ``paths``, ``into`` ends up holding just what they select.
            part: restore only the files rank ``part`` contributed to a checkpoint written
                by several processes (:meth:`~taskpoint.Checkpoint.save_part_sync`);
                ``None``: the whole tree.
            paths: restore only these paths of a directory checkpoint stored in format 2
                (relative to the tree, ``/`` between components, e.g.
                ``["model/__0_0.distcp", ".metadata"]``): the objects other files use are
                never downloaded. A directory path brings everything under it; the
                directories containing each path come along, and so does the file a
                requested hard link shares; a symbolic link comes as a link, without its
                target. With ``part`` too, each path must be one of that part's.
                ``None``: the whole tree.

        Returns:
            The restored file (keeping its name), the restored directory tree, or a file
            named ``checkpoint.bin`` holding saved bytes; ``None`` when nothing has been
            committed. Without ``into`` each call restores afresh into a new folder.

        A checkpoint that fails its checksum or cannot be read back is skipped, with a
        :class:`~taskpoint.TaskpointWarning` naming it, for the next newest. After
        :meth:`prefetch` with the same arguments, it returns what that restore found (or
        raises what it raised) as soon as it is done.

        Uploads to this location still in flight from another process on this machine (the
        upload process of an attempt that died, which goes on to commit its save) are
        waited for first, at most the grace period (``TASKPOINT_GRACE_PERIOD``, default
        30 s), so a retry restores the save its predecessor was committing; an upload
        process that has died is not waited for.

        Raises:
            CheckpointCorruptError: checkpoints exist but none is intact.
            CheckpointFormatError: the newest manifest comes from a newer format.
            CheckpointUnsafeError: a directory archive holds an unsafe entry.
            CheckpointStoreError: the store failed (after retries for transient errors).
            CheckpointCoordinationError: ``part`` was given and the newest checkpoint has
                no such part (one process wrote it, or fewer ranks); or ``paths`` was given
                and the newest checkpoint is not a format-2 tree, or holds none of some of
                them (the message names them). Nothing was restored: an older checkpoint
                is never taken instead.
            ValueError: ``part`` is not a rank; ``paths`` is a string, not a collection,
                or holds a path that is not a relative one inside the tree (empty,
                absolute, or with ``.`` or ``..`` components); ``TASKPOINT_GRACE_PERIOD``
                is set to something other than seconds.
        """
        request = _check_request(into, part, paths)
        pending, self._prefetched = self._prefetched, None
        if pending is not None:
            if pending.request == request:
                began = time.monotonic()
                found = pending.result()
                return self._took(found, waited=time.monotonic() - began)
            pending.drop()  # waits for it: the two must not write one folder at once
        return self._took(self._find(request))

    def prefetch(
        self,
        *,
        into: str | os.PathLike[str] | None = None,
        part: int | None = None,
        paths: Collection[str] | None = None,
    ) -> None:
        """Start :meth:`load_sync`'s restore now, on a background thread, and return.

        A restarted job can download its checkpoint while it imports its framework and
        builds its model, instead of after: the next :meth:`load_sync` (or :meth:`load`)
        with the same arguments returns what this restore found, once it is done, and
        raises what it raised. A load with other arguments waits for it, drops what it
        restored (a fresh folder is removed; a tree restored ``into`` a folder stays) and
        loads as asked. A second ``prefetch`` with the same arguments, before a load took
        the first, does nothing; with others it drops the first in the same way.

        The restore is the one :meth:`load_sync` makes, waits for an earlier attempt's
        uploads in flight included, and records nothing until a load takes it: a
        prefetch that is never loaded leaves no resume in the run's history, and its folder
        goes at interpreter exit. The thread never keeps the interpreter from exiting.

        Raises:
            ValueError: as :meth:`load_sync`, for the arguments; errors of the restore
                itself are raised by the load that takes it.
        """
        request = _check_request(into, part, paths)
        pending = self._prefetched
        if pending is not None and pending.request == request:
            return
        self._prefetched = _Prefetch(request, self._find, after=pending)

    def _find(self, request: _Request) -> tuple[Path, Manifest, float] | None:
        """Wait for uploads in flight here, then restore the newest intact checkpoint."""
        # An earlier attempt's upload process may be about to commit a newer checkpoint.
        _inflight.wait(self._store.url, _inflight.wait_bound())
        self._saves.prepare()  # a job loads before it trains: its saves follow
        return self._loader.load(*request)

    def _took(
        self, found: tuple[Path, Manifest, float] | None, waited: float | None = None
    ) -> Path | None:
        """Record the resume ``found`` (nothing when ``None``); return its path.

        The run's history gets the seconds the restore kept training waiting: ``waited``
        for one a prefetch ran ahead, when shorter than the restore itself."""
        if found is None:
            return None
        path, manifest, elapsed = found
        self._saves.restored = (manifest.size, elapsed, manifest.stats)  # the link's speed
        self._attempt.resumed(manifest, elapsed if waited is None else min(waited, elapsed))
        history.log_resume(self._attempt, manifest)
        return path

    async def load(
        self,
        *,
        into: str | os.PathLike[str] | None = None,
        part: int | None = None,
        paths: Collection[str] | None = None,
    ) -> Path | None:
        """Async :meth:`load_sync`: the download runs in worker threads."""
        return await asyncio.to_thread(
            functools.partial(self.load_sync, into=into, part=part, paths=paths)
        )

"""The load path: find the newest intact checkpoint and restore it to local disk.

:meth:`Loader.load` tries committed checkpoints newest first: one that fails its checksum
or cannot be read back is skipped with a :class:`~taskpoint.TaskpointWarning`; one pruned
while it was read sends the search back to a fresh listing. Format-1 payloads are
downloaded (a file) or streamed through :func:`taskpoint.format.archive.unpack_directory` (a
directory) and checked against the manifest's checksum; format-2 trees are restored by
:func:`taskpoint.format._tree_restore.restore_tree`. A failure of the local disk (full,
read-only, refused) is a :class:`~taskpoint.CheckpointRestoreError`, never taken for a bad
checkpoint (:func:`is_local_write_error`).
"""

from __future__ import annotations

import atexit
import errno
import itertools
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from taskpoint.errors import (
    CheckpointCoordinationError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointRestoreError,
    CheckpointStoreError,
    CheckpointUnsafeError,
    TaskpointWarning,
)
from taskpoint.format import _tree_restore, archive
from taskpoint.format._catalog import Catalog
from taskpoint.format._digest import Digest, HashingReader, Progress, digest_file
from taskpoint.format._statcache import StatCache, now_ns
from taskpoint.format.manifest import CHECKPOINTS, Manifest

__all__ = ["BYTES_NAME", "Loader", "is_local_write_error"]

log = logging.getLogger(__name__)

BYTES_NAME = "checkpoint.bin"
"""The file name a restored bytes payload gets."""

_workdirs: list[str] = []


@atexit.register
def _remove_workdirs() -> None:
    for path in _workdirs:
        shutil.rmtree(path, ignore_errors=True)


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
                log.warning(message)
                warnings.warn(message, TaskpointWarning, stacklevel=4)  # the caller of load_sync
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
                self._workdir = Path(tempfile.mkdtemp(prefix="taskpoint-restore-"))
                _workdirs.append(str(self._workdir))
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

    def _unpack(self, key: str, url: str, manifest: Manifest, path: Path) -> Digest:
        """Stream the archive at ``key`` into ``path``; the digest of what was read."""
        with self._store.open_read(key) as raw:
            reader = HashingReader(raw, self._progress, Digest.matching(manifest.checksum))
            try:
                archive.unpack_directory(reader, path, manifest.codec)  # type: ignore[arg-type]
                reader.drain()
            except (CheckpointStoreError, CheckpointUnsafeError):
                raise
            except Exception as exc:
                if is_local_write_error(exc, path):
                    raise restore_error(exc, str(path)) from exc
                raise CheckpointCorruptError(
                    f"payload {url} cannot be decoded as a directory archive "
                    f"({type(exc).__name__}: {exc})",
                    url=url,
                ) from exc
        return reader.digest

    def _staging_in(self, into: Path) -> Path:
        try:
            into.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=".taskpoint-restore-", dir=into))
        except OSError as exc:
            raise restore_error(exc, str(into)) from exc

    def _restore(self, manifest: Manifest, into: Path | None = None) -> Path:
        key = f"{CHECKPOINTS}/{manifest.payload}"
        url = self._store.url_of(key)
        clock = now_ns()
        staging = self._restore_dir(manifest) if into is None else self._staging_in(into)
        path = staging / (manifest.name or BYTES_NAME)
        try:
            if manifest.is_tree:
                _tree_restore.restore_tree(
                    self._store, manifest, path, existing=into, progress=self._progress,
                    workers=max(16, self._store.transfer.concurrency), seen=self._seen,
                )
                digest = None
            elif manifest.kind == "directory":
                digest = self._unpack(key, url, manifest, path)
            else:
                self._store.get_file(key, str(path))
                digest = digest_file(str(path), Digest.matching(manifest.checksum).algorithm)
                if self._progress is not None:
                    self._progress(digest.size)
            if digest is not None and (
                digest.size != manifest.size or digest.checksum != manifest.checksum
            ):
                raise CheckpointCorruptError(
                    f"payload {url} does not match its manifest: {digest.size} bytes with "
                    f"{digest.checksum}, expected {manifest.size} bytes with {manifest.checksum}",
                    url=url,
                )
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


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""Errors only a write can meet: a full disk or quota, a file over the size limit."""
_REFUSED_ERRNOS = {
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
    errno.EMFILE, errno.ENFILE, errno.EIO,
}
"""Errors that are the restore directory's when they name a path inside it."""


def is_local_write_error(exc: BaseException, staging: Path) -> bool:
    """Whether ``exc`` is the local disk refusing what a restore writes under ``staging``."""
    if not isinstance(exc, OSError) or exc.errno is None:
        return False  # decoders raise OSError without an errno for bad data
    if exc.errno in _FULL_ERRNOS:
        return True
    if exc.errno not in _REFUSED_ERRNOS:
        return False
    base = os.path.abspath(staging)
    for name in (exc.filename, exc.filename2):
        if isinstance(name, str) and os.path.abspath(name).startswith(base):
            return True
    return False


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

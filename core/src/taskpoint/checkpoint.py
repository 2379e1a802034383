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
action's location and attempt.

A save writes the payload under a fresh name, then its manifest (the commit), then prunes
checkpoints beyond the newest ``keep``. A crash at any point leaves the newest committed
checkpoint loadable; a reader never sees a half-written one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Union

from taskpoint import archive
from taskpoint._digest import (
    Digest,
    HashingReader,
    HashingWriter,
    Progress,
    digest_file,
    file_chunks,
)
from taskpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointStoreError,
    CheckpointUnsafeError,
    TaskpointWarning,
)
from taskpoint.manifest import (
    FORMAT_VERSION,
    Codec,
    Manifest,
    check_format,
    parse_manifest_name,
    parse_payload_name,
    payload_name,
)
from taskpoint.store import RetryPolicy, Store

__all__ = ["Checkpoint", "SaveInput", "latest_checkpoint"]

log = logging.getLogger(__name__)

SaveInput = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]"]
"""What ``save`` accepts: raw bytes, or the path of a file or directory."""

CHECKPOINTS = "checkpoints"
"""The folder, under a checkpoint's URL, that holds manifests and payloads."""
ATTEMPTS = "attempts"
"""The folder, under a checkpoint's URL, that holds one marker per claimed attempt."""
STATUS = "status.json"
"""The object, under a checkpoint's URL, that records how the action finished."""
BYTES_NAME = "checkpoint.bin"
BACKGROUND_NICE = 10
"""The nice value background uploads run at, below the training loop's threads."""
"""The file name a restored bytes payload gets."""


@dataclass(frozen=True)
class _Source:
    kind: str
    data: bytes | None = None
    path: Path | None = None
    snapshot: Path | None = None  # a private copy's folder, removed once uploaded


def _classify(data: object) -> _Source:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _Source("bytes", data=bytes(data))
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
            return _Source("directory", path=path.absolute())
        if stat.S_ISREG(mode):
            return _Source("file", path=path.absolute())
        raise ValueError(
            f"cannot checkpoint {str(path)!r}: it is neither a regular file nor a directory"
        )
    raise TypeError(
        "checkpoint save() takes bytes, bytearray or memoryview (stored as raw bytes) or a "
        f"str / os.PathLike naming a file or directory; got {type(data).__name__}"
    )


_workdirs: list[str] = []


@atexit.register
def _remove_workdirs() -> None:
    for path in _workdirs:
        shutil.rmtree(path, ignore_errors=True)


class Checkpoint:
    """A checkpoint location: ``save`` commits new state, ``load`` restores the newest.

    Args:
        url: where checkpoints live: a local path or any fsspec URL (``s3://b/p``,
            ``gs://b/p``, ``az://c/p``, ``memory://p``, ``file:///p``).
        attempt: the attempt number this process saves as. ``None`` claims the next
            free number from the store at the first save, so two restarts never share one.
        keep: how many committed checkpoints to keep (newest first); at least 1.
        codec: how directories are compressed: ``"gzip"``, ``"zstd"`` or ``"none"``.
        storage_options: passed to the fsspec filesystem (credentials, endpoints).
        workdir: local folder that ``load`` restores into; a temporary folder, removed at
            interpreter exit, by default.
        retry: how store calls retry transient failures.
        progress: called with the number of payload bytes moved, as saves and loads stream.

    Raises:
        ValueError: ``keep`` is below 1, ``attempt`` is negative or ``codec`` is unknown.
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
    ) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise TypeError(f"url must be a str or os.PathLike; got {type(url).__name__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int of at least 1; got {keep!r}")
        if attempt is not None and (not isinstance(attempt, int) or attempt < 0):
            raise ValueError(f"attempt must be a non-negative int or None; got {attempt!r}")
        self._codec: Codec = archive.check_codec(codec)
        self._store = Store(os.fspath(url), storage_options, retry)
        self._attempt = attempt
        self._keep = keep
        self._workdir = Path(workdir) if workdir is not None else None
        self._save_lock = threading.Lock()
        self._tickets = itertools.count()
        self._seq_base: int | None = None
        self._loads = itertools.count()
        self._progress = progress
        self._background = _Background(self._save)

    @classmethod
    def at(cls, url: str | os.PathLike[str], **options: Any) -> Checkpoint:
        """Bind a checkpoint to ``url`` explicitly, outside any taskpoint task.

        Same arguments as the constructor. Useful inside another orchestrator's task
        (a Flyte task, a Kubernetes Job) that retries on its own: each process claims a new
        attempt number from the store and resumes from the newest committed checkpoint.
        """
        return cls(url, **options)

    def __repr__(self) -> str:
        return f"Checkpoint({self._store.url!r}, attempt={self._attempt!r}, keep={self._keep})"

    @property
    def url(self) -> str:
        """The checkpoint location's URL."""
        return self._store.url

    @property
    def attempt(self) -> int | None:
        """The attempt number saves are made as; ``None`` until claimed from the store."""
        return self._attempt

    # -- saving -----------------------------------------------------------------------

    def save_sync(self, data: SaveInput, *, background: bool = False) -> None:
        """Commit ``data`` as the newest checkpoint.

        Args:
            data: raw bytes (bytes, bytearray, memoryview), or the path (str or
                os.PathLike) of a file, stored as-is, or of a directory, stored as one
                compressed tar archive.
            background: snapshot ``data`` (a local copy of the file or tree) and return;
                the upload runs in a background thread. Changing the file or tree afterwards
                cannot change the checkpoint. A newer save supersedes a background save still
                queued. Its errors are raised by the next save or by :meth:`wait`.

        Concurrent saves on one ``Checkpoint`` run one at a time; the one started last
        is the newest once all have returned.

        Raises:
            TypeError: ``data`` is of another type.
            FileNotFoundError: the path does not exist.
            CheckpointUnsafeError: the directory holds a special file or a link leaving it.
            CheckpointStoreError: the store failed (this save's, or an earlier background
                save's); earlier checkpoints are untouched.
        """
        self._raise_background_error()
        source = _classify(data)
        ticket = next(self._tickets)
        if background:
            self._background.submit(_snapshot(source), ticket)
        else:
            self._background.supersede(ticket)
            self._save(source, ticket)

    async def save(self, data: SaveInput, *, background: bool = False) -> None:
        """Async :meth:`save_sync`: the snapshot and upload run in worker threads."""
        self._raise_background_error()
        source = _classify(data)
        ticket = next(self._tickets)
        if background:
            snapshot = await asyncio.to_thread(_snapshot, source)
            self._background.submit(snapshot, ticket)
        else:
            self._background.supersede(ticket)
            await asyncio.to_thread(self._save, source, ticket)

    def wait(self) -> None:
        """Block until background saves have committed.

        Raises:
            CheckpointError: what the last failed background save raised.
        """
        self._background.wait()
        self._raise_background_error()

    def _raise_background_error(self) -> None:
        error = self._background.take_error()
        if error is not None:
            raise error

    def _save(self, source: _Source, ticket: int) -> None:
        started = time.monotonic()
        with self._save_lock:
            attempt = self._claim_attempt()
            seq = self._next_seq(attempt, ticket)
            token = uuid.uuid4().hex[:8]
            payload = payload_name(attempt, seq, token)
            digest, name, codec = self._write_payload(source, payload)
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
            )
            self._store.write_atomic(f"{CHECKPOINTS}/{manifest.key}", manifest.to_json())
            log.info(
                "committed %s checkpoint %s (%d bytes) in %.2fs",
                source.kind, self._store.url_of(f"{CHECKPOINTS}/{manifest.key}"),
                digest.size, time.monotonic() - started,
            )
            self._prune()

    def _write_payload(self, source: _Source, payload: str) -> tuple[Digest, str | None, Codec]:
        target = f"{CHECKPOINTS}/{payload}"
        name = source.path.name if source.path is not None else None
        if source.kind == "file" and self._store.is_object_store:
            # The backend's own parallel multipart upload, after hashing the file. A file
            # changed while it uploads fails verification at load.
            assert source.path is not None
            digest = digest_file(str(source.path))
            self._store.put_file(str(source.path), target)
            if self._progress is not None:
                self._progress(digest.size)
            return digest, name, "none"
        box: dict[str, HashingWriter] = {}

        def produce(raw: BinaryIO) -> None:
            writer = box["w"] = HashingWriter(raw, self._progress)
            if source.kind == "bytes":
                assert source.data is not None
                writer.write(source.data)
            elif source.kind == "file":
                # One pass that hashes as it copies: as fast as a kernel copy on local disks,
                # where reading the file a second time to hash it would cost a third more.
                assert source.path is not None
                for chunk in file_chunks(str(source.path)):
                    writer.write(chunk)
            else:
                assert source.path is not None
                archive.pack_directory(source.path, writer, self._codec)  # type: ignore[arg-type]

        self._store.write_stream(target, produce)
        codec: Codec = self._codec if source.kind == "directory" else "none"
        return box["w"].digest, name, codec

    def _claim_attempt(self) -> int:
        if self._attempt is None:
            taken = [int(n) for n in self._store.list(ATTEMPTS) if n.isdigit()]
            if taken:
                self._check_marker(max(taken))
            self._attempt = max(taken, default=-1) + 1
            self._mark_attempt(self._attempt)
        return self._attempt

    def _mark_attempt(self, attempt: int) -> None:
        record = {"format": FORMAT_VERSION, "started": time.time(), "pid": os.getpid()}
        self._store.write_atomic(f"{ATTEMPTS}/{attempt:06d}", json.dumps(record).encode())

    def _check_marker(self, attempt: int) -> None:
        """Refuse to add an attempt to an action a newer taskpoint has written to."""
        key = f"{ATTEMPTS}/{attempt:06d}"
        try:
            record = json.loads(self._store.read_bytes(key))
        except (FileNotFoundError, ValueError):
            return  # a marker is a name first; its content is informational
        check_format(record, url=self._store.url_of(key))

    def _next_seq(self, attempt: int, ticket: int) -> int:
        if self._seq_base is None:
            seqs = [
                order[1]
                for order in map(parse_manifest_name, self._store.list(CHECKPOINTS))
                if order is not None and order[0] == attempt
            ]
            self._seq_base = max(seqs, default=-1) + 1
        return self._seq_base + ticket

    def _prune(self) -> None:
        self.prune(self._keep)

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` committed checkpoints, and stale payloads.

        ``keep=0`` deletes every checkpoint. Manifests go before their payloads, so a
        reader never finds a manifest whose payload is gone for good.

        Raises:
            ValueError: ``keep`` is negative.
            CheckpointStoreError: the store failed.
        """
        if keep < 0:
            raise ValueError(f"keep must be >= 0; got {keep!r}")
        names = self._store.list(CHECKPOINTS)
        committed = sorted(
            (order, name) for name in names if (order := parse_manifest_name(name)) is not None
        )
        if not committed:
            return
        cut = max(0, len(committed) - keep)
        kept = {order for order, _ in committed[cut:]}
        newest = committed[-1][0]
        for _, name in committed[:cut]:
            self._store.remove(f"{CHECKPOINTS}/{name}")
        for name in names:
            order = parse_payload_name(name)
            if order is not None and order not in kept and order <= newest:
                self._store.remove(f"{CHECKPOINTS}/{name}")

    def delete(self) -> None:
        """Delete everything stored at this checkpoint's URL: checkpoints, markers, status.

        Raises:
            CheckpointStoreError: the store failed.
        """
        self._store.remove_tree()

    def verify(self, manifest: Manifest) -> bool:
        """Whether ``manifest``'s payload exists and matches its size and checksum.

        Reads the payload through without writing it anywhere.

        Raises:
            CheckpointStoreError: the store failed.
        """
        try:
            with self._store.open_read(f"{CHECKPOINTS}/{manifest.payload}") as raw:
                reader = HashingReader(raw, self._progress, Digest.matching(manifest.checksum))
                reader.drain()
        except FileNotFoundError:
            return False
        return reader.digest.size == manifest.size and reader.digest.checksum == manifest.checksum

    def mark_finished(self, state: str, *, attempts: int) -> None:
        """Record that the action ended (``"succeeded"`` or ``"failed"``) after ``attempts``.

        Best effort: a store failure is logged, not raised, so it never hides the task's
        own outcome. ``taskpoint gc``/``rm`` treat actions without this record as unfinished.
        """
        record = {
            "format": FORMAT_VERSION, "state": state, "attempts": attempts, "finished": time.time()
        }
        try:
            self._store.write_atomic(STATUS, json.dumps(record).encode())
        except CheckpointError as exc:
            log.warning("could not record %s as %s: %s", self._store.url, state, exc)

    def status(self) -> dict[str, Any] | None:
        """The record :meth:`mark_finished` wrote, or ``None`` while the action is unfinished.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointFormatError: a newer taskpoint wrote the record.
        """
        try:
            raw = json.loads(self._store.read_bytes(STATUS))
        except (FileNotFoundError, ValueError):
            return None
        check_format(raw, url=self._store.url_of(STATUS))
        return raw if isinstance(raw, dict) else None

    # -- loading ----------------------------------------------------------------------

    def committed(self) -> list[Manifest]:
        """The committed checkpoints' manifests, newest first, without verifying payloads.

        Manifests that cannot be parsed are left out.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointFormatError: a manifest comes from a newer format.
        """
        result = []
        for name in reversed(self._manifest_names()):
            try:
                result.append(self._read_manifest(name))
            except (CheckpointCorruptError, FileNotFoundError):
                continue
        return result

    def _manifest_names(self) -> list[str]:
        names = self._store.list(CHECKPOINTS)
        return sorted(
            (n for n in names if parse_manifest_name(n) is not None),
            key=lambda n: parse_manifest_name(n) or (0, 0),
        )

    def _read_manifest(self, name: str) -> Manifest:
        key = f"{CHECKPOINTS}/{name}"
        return Manifest.from_json(self._store.read_bytes(key), url=self._store.url_of(key))

    def load_sync(self) -> Path | None:
        """Restore the newest intact committed checkpoint to a local path.

        Returns:
            The restored file (keeping its name), the restored directory tree, or a file
            named ``checkpoint.bin`` holding saved bytes; ``None`` when nothing has been
            committed. Each call restores afresh into a new folder.

        A checkpoint that fails its checksum or cannot be read back is skipped, with a
        :class:`~taskpoint.TaskpointWarning` naming it, for the next newest.

        Raises:
            CheckpointCorruptError: checkpoints exist but none is intact.
            CheckpointFormatError: the newest manifest comes from a newer format.
            CheckpointUnsafeError: a directory archive holds an unsafe entry.
            CheckpointStoreError: the store failed (after retries for transient errors).
        """
        for _ in range(5):
            names = self._manifest_names()
            if not names:
                log.info("no checkpoint committed at %s", self._store.url)
                return None
            path, skipped, pruned = self._load_newest(names)
            if path is not None:
                return path
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

    def _load_newest(self, names: list[str]) -> tuple[Path | None, list[str], bool]:
        """Restore the newest intact of ``names``; also report skipped and pruned ones."""
        skipped: list[str] = []
        pruned = False
        for name in reversed(names):
            url = self._store.url_of(f"{CHECKPOINTS}/{name}")
            try:
                manifest = self._read_manifest(name)
                started = time.monotonic()
                path = self._restore(manifest)
            except (CheckpointStoreError, CheckpointFormatError, CheckpointUnsafeError):
                raise
            except (CheckpointError, FileNotFoundError) as exc:
                if name not in self._store.list(CHECKPOINTS):
                    pruned = True  # replaced by a newer commit while we read it
                    continue
                skipped.append(url)
                message = f"skipping checkpoint {url}: {exc}"
                log.warning(message)
                warnings.warn(message, TaskpointWarning, stacklevel=3)
                continue
            log.info(
                "restored %s checkpoint %s (%d bytes) in %.2fs",
                manifest.kind, url, manifest.size, time.monotonic() - started,
            )
            return path, skipped, pruned
        return None, skipped, pruned

    async def load(self) -> Path | None:
        """Async :meth:`load_sync`: the download runs in a worker thread."""
        return await asyncio.to_thread(self.load_sync)

    def _restore_dir(self, manifest: Manifest) -> Path:
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="taskpoint-restore-"))
            _workdirs.append(str(self._workdir))
        target = self._workdir / f"{manifest.attempt:06d}-{manifest.seq:09d}-{next(self._loads)}"
        target.mkdir(parents=True, exist_ok=False)
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
                raise CheckpointCorruptError(
                    f"payload {url} cannot be decoded as a directory archive "
                    f"({type(exc).__name__}: {exc})",
                    url=url,
                ) from exc
        return reader.digest

    def _restore(self, manifest: Manifest) -> Path:
        key = f"{CHECKPOINTS}/{manifest.payload}"
        url = self._store.url_of(key)
        staging = self._restore_dir(manifest)
        path = staging / (manifest.name or BYTES_NAME)
        try:
            if manifest.kind == "directory":
                digest = self._unpack(key, url, manifest, path)
            else:
                self._store.get_file(key, str(path))
                digest = digest_file(str(path), Digest.matching(manifest.checksum).algorithm)
                if self._progress is not None:
                    self._progress(digest.size)
            if digest.size != manifest.size or digest.checksum != manifest.checksum:
                raise CheckpointCorruptError(
                    f"payload {url} does not match its manifest: {digest.size} bytes with "
                    f"{digest.checksum}, expected {manifest.size} bytes with {manifest.checksum}",
                    url=url,
                )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return path


def _snapshot(source: _Source) -> _Source:
    """A private copy of ``source`` that later changes to the original cannot reach."""
    if source.path is None:
        return source
    folder = Path(tempfile.mkdtemp(prefix="taskpoint-snapshot-"))
    target = folder / source.path.name
    if source.kind == "directory":
        shutil.copytree(source.path, target, symlinks=True)
    else:
        shutil.copy2(source.path, target)
    return _Source(source.kind, path=target, snapshot=folder)


class _Background:
    """One upload thread per checkpoint, holding at most one queued save.

    A queued save is dropped when a newer one (background or not) starts; its snapshot is
    removed. The error of a failed save is kept until :meth:`take_error`.
    """

    def __init__(self, save: Callable[[_Source, int], None]) -> None:
        self._save = save
        self._cond = threading.Condition()
        self._queued: tuple[_Source, int] | None = None
        self._running = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, source: _Source, ticket: int) -> None:
        with self._cond:
            self._drop_queued()
            self._queued = (source, ticket)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="taskpoint-background-save", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def supersede(self, ticket: int) -> None:
        with self._cond:
            if self._queued is not None and self._queued[1] < ticket:
                self._drop_queued()
                self._cond.notify_all()

    def _drop_queued(self) -> None:
        if self._queued is not None:
            _discard(self._queued[0])
            self._queued = None

    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                if self._queued is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                source, ticket = self._queued
                self._queued = None
                self._running = True
            try:
                self._save(source, ticket)
            except BaseException as exc:  # kept for the caller's next save or wait()
                log.warning("background save failed: %s", exc)
                with self._cond:
                    self._error = exc
            finally:
                _discard(source)
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._queued is not None or self._running:
                self._cond.wait()

    def take_error(self) -> BaseException | None:
        with self._cond:
            error, self._error = self._error, None
            return error


def _lower_priority() -> None:
    """Make the calling thread (and the threads it starts) yield the CPU to training.

    Linux schedules threads individually, so this lowers the upload's priority only.
    """
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def _discard(source: _Source) -> None:
    if source.snapshot is not None:
        shutil.rmtree(source.snapshot, ignore_errors=True)


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

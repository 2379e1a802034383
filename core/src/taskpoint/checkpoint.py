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
import dataclasses
import errno
import functools
import itertools
import json
import logging
import os
import pickle
import shutil
import stat
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, Union

from taskpoint import _uploader, archive, history, retention, tree
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
    CheckpointRestoreError,
    CheckpointStoreError,
    CheckpointUnsafeError,
    TaskpointWarning,
)
from taskpoint.history import ATTEMPTS, SaveStats
from taskpoint.manifest import (
    FORMAT_VERSION,
    TREE_FORMAT,
    Codec,
    Manifest,
    check_format,
    loads_record,
    manifest_name,
    parse_manifest_name,
    parse_payload_name,
    payload_name,
    tree_checksum,
)
from taskpoint.store import RetryPolicy, Store, check_location

__all__ = ["Checkpoint", "SaveInput", "latest_checkpoint"]

log = logging.getLogger(__name__)

SaveInput = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]"]
"""What ``save`` accepts: raw bytes, or the path of a file or directory."""

CHECKPOINTS = "checkpoints"
"""The folder, under a checkpoint's URL, that holds manifests and payloads."""
STATUS = "status.json"
"""The object, under a checkpoint's URL, that records how the action finished."""
BYTES_NAME = "checkpoint.bin"
"""The file name a restored bytes payload gets."""
BACKGROUND_NICE = 10
"""The nice value background uploads run at, below the training loop's threads."""


@dataclass(frozen=True)
class _Source:
    kind: str
    data: bytes | None = None
    path: Path | None = None
    snapshot: Path | None = None  # a private copy's folder, removed once uploaded
    called: float = 0.0  # time.monotonic() when save was called
    blocked_s: float | None = None  # how long a background save held its caller


def _classify(data: object, called: float) -> _Source:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _Source("bytes", data=bytes(data), called=called)
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
            return _Source("directory", path=path.absolute(), called=called)
        if stat.S_ISREG(mode):
            return _Source("file", path=path.absolute(), called=called)
        raise ValueError(
            f"cannot checkpoint {str(path)!r}: it is neither a regular file nor a directory"
        )
    raise TypeError(
        "checkpoint save() takes bytes, bytearray or memoryview (stored as raw bytes) or a "
        f"str / os.PathLike naming a file or directory; got {type(data).__name__}"
    )


_workdirs: list[str] = []
_workers: list[_uploader.Worker] = []


@atexit.register
def _remove_workdirs() -> None:
    for path in _workdirs:
        shutil.rmtree(path, ignore_errors=True)


@atexit.register
def _close_workers() -> None:
    for worker in _workers:
        worker.close()


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
        background_upload: where background saves upload: ``"process"`` (a separate
            upload process, so the upload's Python work never holds the training loop's
            GIL) or ``"thread"`` (a thread of this process). ``memory://`` stores and
            checkpoints with a ``progress`` callback always use a thread.

        store_format: how directories are stored: ``2`` (the default) stores each file
            once by content, so a save uploads only what changed and a load into an
            existing folder fetches only what is missing; ``1`` stores one tar archive per
            checkpoint, which any ``tar xzf`` reads (and taskpoint before 0.2).


    Raises:
        ValueError: ``url`` is blank, ``keep`` is below 1, ``attempt`` is negative,
            ``codec`` or ``background_upload`` is unknown, or ``store_format`` is
            neither 1 nor 2.
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
    ) -> None:
        url = check_location("url", url)
        if store_format not in (1, TREE_FORMAT) or isinstance(store_format, bool):
            raise ValueError(f"store_format must be 1 or {TREE_FORMAT}; got {store_format!r}")
        self._store_format = store_format
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int of at least 1; got {keep!r}")
        if attempt is not None and (not isinstance(attempt, int) or attempt < 0):
            raise ValueError(f"attempt must be a non-negative int or None; got {attempt!r}")
        self._codec: Codec = archive.check_codec(codec)
        if background_upload not in ("process", "thread"):
            raise ValueError(
                f'background_upload must be "process" or "thread"; got {background_upload!r}'
            )
        self._store = Store(url, storage_options, retry)
        self._options: dict[str, Any] = {
            "url": url, "keep": keep, "codec": codec, "retry": retry,
            "storage_options": dict(storage_options or {}), "background_upload": "thread",
            "store_format": store_format,
        }
        self._background_upload = background_upload
        self._worker: _uploader.Worker | None = None
        self._attempt = attempt
        self._keep = keep
        self._workdir = Path(workdir) if workdir is not None else None
        self._save_lock = threading.Lock()
        self._tickets = itertools.count()
        self._seq_base: int | None = None
        self._loads = itertools.count()
        self._progress = progress
        self._background = _Background(self._save)
        self._listeners: list[Callable[[SaveStats], object]] = []
        self._intact: set[tuple[str, str]] = set()  # (manifest key, checksum) known good
        self._resumed: tuple[Manifest, float] | None = None  # recorded once claimed
        self._manifests: dict[str, Manifest] = {}  # committed manifests read, by name

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

    def save_sync(
        self, data: SaveInput, *, background: bool = False, snapshot: Snapshot = "copy"
    ) -> None:
        """Commit ``data`` as the newest checkpoint.

        Args:
            data: raw bytes (bytes, bytearray, memoryview), or the path (str or
                os.PathLike) of a file, stored as-is, or of a directory, stored as one
                compressed tar archive.
            background: snapshot ``data`` (a local copy of the file or tree) and return;
                the upload runs in a background thread. Changing the file or tree afterwards
                cannot change the checkpoint. A newer save supersedes a background save still
                queued. Its errors are raised by the next save or by :meth:`wait`.
            snapshot: how a background save snapshots a path. ``"copy"`` copies it;
                ``"link"`` hard-links its files where the disk allows (copying the rest),
                which is instant but only safe for files that are replaced or deleted,
                never rewritten in place (what the Trainer and Lightning do with finished
                checkpoints; ``torch.save`` over an existing path rewrites it in place).

        Concurrent saves on one ``Checkpoint`` run one at a time; the one started last
        is the newest once all have returned.

        Raises:
            TypeError: ``data`` is of another type.
            ValueError: ``snapshot`` is neither ``"copy"`` nor ``"link"``.
            FileNotFoundError: the path does not exist.
            CheckpointUnsafeError: the directory holds a special file or a link leaving it.
            CheckpointStoreError: the store failed (this save's, or an earlier background
                save's); earlier checkpoints are untouched.
        """
        called = time.monotonic()
        _check_snapshot(snapshot)
        self._raise_background_error()
        source = _classify(data, called)
        ticket = next(self._tickets)
        if background:
            self._background.submit(_snapshot(source, snapshot), ticket)
        else:
            self._background.supersede(ticket)
            self._save(source, ticket)

    async def save(
        self, data: SaveInput, *, background: bool = False, snapshot: Snapshot = "copy"
    ) -> None:
        """Async :meth:`save_sync`: the snapshot and upload run in worker threads."""
        called = time.monotonic()
        _check_snapshot(snapshot)
        self._raise_background_error()
        source = _classify(data, called)
        ticket = next(self._tickets)
        if background:
            private = await asyncio.to_thread(_snapshot, source, snapshot)
            self._background.submit(private, ticket)
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

    def on_commit(self, callback: Callable[[SaveStats], object]) -> Callable[[SaveStats], object]:
        """Call ``callback`` with a :class:`~taskpoint.SaveStats` after each commit.

        It runs in the thread that committed: the caller's for blocking saves, the upload
        thread for background ones; what it raises is logged, never raised into a save.
        Usable as a decorator; returns ``callback``.
        """
        self._listeners.append(callback)
        return callback

    def _save(self, source: _Source, ticket: int) -> None:
        with self._save_lock:
            attempt = self._claim_attempt()
            seq = self._next_seq(attempt, ticket)
            if source.blocked_s is not None and self._upload_in_process:
                if self._worker is None:
                    self._worker = _uploader.Worker()
                    _workers.append(self._worker)
                request = _uploader.Request(
                    self._options, attempt, seq, source, frozenset(self._intact)
                )
                stats, intact = self._worker.run(request)
                self._intact.add(intact)
            else:
                stats, _ = self._commit(source, attempt, seq)
        self._notify(stats)

    @property
    def _upload_in_process(self) -> bool:
        """Whether background saves run in the upload process (see :mod:`taskpoint._uploader`)."""
        if self._background_upload != "process" or self._progress is not None:
            return False  # a progress callback cannot cross processes
        if self._store.is_memory:
            return False  # memory:// lives in this process alone
        try:
            pickle.dumps(self._options)
        except Exception:  # storage_options holding a live client object, say
            self._background_upload = "thread"
            return False
        return True

    def _commit(
        self, source: _Source, attempt: int, seq: int
    ) -> tuple[SaveStats, tuple[str, str]]:
        """Write ``source`` as save ``seq`` of ``attempt``, commit it, prune; with the save lock
        held (or in the upload process). Returns its stats and its ``(key, checksum)``."""
        if source.kind == "directory" and self._store_format == TREE_FORMAT:
            committed = self._save_tree(source, attempt, seq)
        else:
            committed = self._save_payload(source, attempt, seq)
        self._prune()
        return committed

    def _save_tree(
        self, source: _Source, attempt: int, seq: int
    ) -> tuple[SaveStats, tuple[str, str]]:
        """Commit a format-2 tree: content the run holds is referenced, the rest uploaded."""
        assert source.path is not None
        key = f"{CHECKPOINTS}/{manifest_name(attempt, seq)}"
        with retention.Lease(self._store, attempt, seq) as lease:
            upload_started = time.monotonic()
            known = tree.BlobIndex.of(self._read_committed())
            saved = tree.save_tree(
                self._store, source.path, known, codec=self._codec,
                workers=self._store.transfer.concurrency, progress=self._progress,
            )
            stats = SaveStats(
                url=self._store.url_of(key), attempt=attempt, seq=seq, kind=source.kind,
                size=saved.size, uploaded=saved.uploaded, reused=saved.reused, save_s=0.0,
                upload_s=0.0, blocked_s=0.0, background=source.blocked_s is not None,
            )
            manifest = Manifest(
                kind="directory", name=source.path.name, codec="none", size=saved.size,
                checksum=tree_checksum(saved.entries), payload=None, attempt=attempt, seq=seq,
                created=time.time(), format=TREE_FORMAT,
                stats=self._timed(stats, source, upload_started).to_record(),
                entries=saved.entries, objects=saved.objects,
            )
            lease.check()
            self._store.write_atomic(key, manifest.to_json())
        self._manifests[manifest.key] = manifest
        self._intact.add((manifest.key, manifest.checksum))
        stats = self._timed(stats, source, upload_started)
        log.info(
            "committed directory checkpoint %s (%d bytes, %d uploaded) in %.2fs",
            stats.url, saved.size, saved.uploaded, stats.save_s,
        )
        return stats, (manifest.key, manifest.checksum)

    def _read_committed(self, strict: bool = False) -> list[Manifest]:
        """The committed manifests, listed now; each read from the store only once.

        With ``strict``, a manifest that cannot be read raises instead of being left out.
        """
        names = [n for n in self._manifest_names()]
        listed = set(names)
        for name in list(self._manifests):
            if name not in listed:
                del self._manifests[name]
        for name in names:
            if name in self._manifests:
                continue
            try:
                self._manifests[name] = self._read_manifest(name)
            except FileNotFoundError:
                continue  # pruned since the listing: it references nothing any more
            except (CheckpointCorruptError, CheckpointFormatError):
                if strict:
                    raise
        return [self._manifests[n] for n in names if n in self._manifests]

    def collect(self) -> retention.Collected:
        """Delete content objects that no committed checkpoint references.

        Safe while other processes save to the same run (see :mod:`taskpoint.retention`):
        a round is skipped while any save is in flight. Saves collect after pruning.

        Raises:
            CheckpointStoreError: the store failed.
        """
        return retention.collect(
            self._store, lambda: self._read_committed(strict=True),
            concurrency=self._store.transfer.concurrency,
        )

    def _save_payload(
        self, source: _Source, attempt: int, seq: int
    ) -> tuple[SaveStats, tuple[str, str]]:
        token = uuid.uuid4().hex[:8]
        payload = payload_name(attempt, seq, token)
        upload_started = time.monotonic()
        digest, name, codec = self._write_payload(source, payload)
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
        )
        self._store.write_atomic(key, manifest.to_json())
        self._intact.add((manifest.key, manifest.checksum))
        stats = self._timed(stats, source, upload_started)
        log.info(
            "committed %s checkpoint %s (%d bytes) in %.2fs",
            source.kind, stats.url, digest.size, stats.save_s,
        )
        return stats, (manifest.key, manifest.checksum)

    @staticmethod
    def _timed(stats: SaveStats, source: _Source, upload_started: float) -> SaveStats:
        now = time.monotonic()
        save_s = now - source.called
        return dataclasses.replace(
            stats,
            save_s=save_s,
            upload_s=now - upload_started,
            blocked_s=save_s if source.blocked_s is None else source.blocked_s,
        )

    def _notify(self, stats: SaveStats) -> None:
        for listener in list(self._listeners):
            try:
                listener(stats)
            except Exception:
                log.exception("an on_commit listener of %s failed", self._store.url)

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
            taken = history.attempt_numbers(self._store)
            if taken:
                self._check_marker(taken[-1])
            self._attempt = history.claim_attempt(self._store, taken[-1] + 1 if taken else 0)
            if self._resumed is not None:
                history.record_resume(self._store, self._attempt, *self._resumed)
        return self._attempt

    def _check_marker(self, attempt: int) -> None:
        """Refuse to add an attempt to an action a newer taskpoint has written to."""
        key = f"{ATTEMPTS}/{attempt:06d}"
        try:
            record = loads_record(self._store.read_bytes(key))
        except (FileNotFoundError, ValueError):
            return  # a marker is a name first; its content is informational
        check_format(record, url=self._store.url_of(key))

    def mark_started(self) -> None:
        """Record that this checkpoint's attempt started (its runner numbered it).

        Best effort, like every run record (see :mod:`taskpoint.history`).
        """
        if self._attempt is not None:
            history.mark_attempt(self._store, self._attempt)

    def mark_ended(self, outcome: history.Outcome, error: str | None = None) -> None:
        """Record how this checkpoint's attempt ended; nothing if it never claimed one.

        Best effort, like every run record (see :mod:`taskpoint.history`).

        Raises:
            ValueError: ``outcome`` is not one of :data:`taskpoint.history.OUTCOMES`.
        """
        if self._attempt is not None:
            history.record_end(self._store, self._attempt, outcome, error)

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
        if self._prune_manifests(self._keep) and self._store.list(retention.OBJECTS):
            self.collect()

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` intact checkpoints; delete what is older, and stale payloads.

        What counts is the checkpoints a load could return, never names alone: the newest
        checkpoints are verified (a checkpoint this object committed or restored is known
        intact and not read again) until ``keep`` intact ones are found, and only
        checkpoints older than the oldest of those are deleted. Unreadable or corrupt
        records newer than that stay where they are (a load skips them), so they can
        never push an intact checkpoint out. With fewer than ``keep`` intact checkpoints
        nothing is deleted. ``keep=0`` deletes every checkpoint.

        Manifests go before their payloads, so a reader never finds a manifest whose
        payload is gone for good. The content objects of format-2 checkpoints are freed
        by :meth:`collect` (which saves run after pruning).

        Raises:
            ValueError: ``keep`` is negative.
            CheckpointStoreError: the store failed.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int of at least 0; got {keep!r}")
        self._prune_manifests(keep)

    def _prune_manifests(self, keep: int) -> int:
        """:meth:`prune`'s work; how many manifests it deleted."""
        names = self._store.list(CHECKPOINTS)
        manifests = sorted(
            (order, name) for name in names if (order := parse_manifest_name(name)) is not None
        )
        cut = self._retention_cut(manifests, keep)
        if cut is None:
            return 0
        doomed = [name for order, name in manifests if order < cut]
        for name in doomed:
            self._store.remove(f"{CHECKPOINTS}/{name}")
        remaining = {order for order, _ in manifests if order >= cut}
        for name in names:
            order = parse_payload_name(name)
            if order is not None and order < cut and order not in remaining:
                self._store.remove(f"{CHECKPOINTS}/{name}")
        return len(doomed)

    def _retention_cut(
        self, manifests: list[tuple[tuple[int, int], str]], keep: int
    ) -> tuple[int, int] | None:
        """The order of the oldest checkpoint kept; ``None`` when nothing may be deleted."""
        if keep == 0:
            return (sys.maxsize, sys.maxsize)
        found = 0
        for order, name in reversed(manifests):
            try:
                manifest = self._read_manifest(name)
            except (CheckpointCorruptError, CheckpointFormatError, FileNotFoundError):
                continue
            if self._is_intact(manifest):
                found += 1
                if found == keep:
                    return order
        return None

    def _is_intact(self, manifest: Manifest) -> bool:
        known = (manifest.key, manifest.checksum)
        if known in self._intact:
            return True
        if not self.verify(manifest):
            return False
        self._intact.add(known)
        return True

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
        if manifest.is_tree:
            return tree.verify_tree(self._store, manifest)
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
            raw = loads_record(self._store.read_bytes(STATUS))
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

    def load_sync(self, *, into: str | os.PathLike[str] | None = None) -> Path | None:
        """Restore the newest intact committed checkpoint to a local path.

        Args:
            into: a local directory to restore into instead of a fresh folder. A directory
                checkpoint's tree *becomes* ``into``: files already there with the right
                size and content are kept rather than downloaded (a retry on the same
                machine fetches only what is missing), the others are replaced, and
                anything the checkpoint does not hold is removed. A file or bytes
                checkpoint is placed in ``into`` under its name. Nothing in ``into``
                changes unless the whole checkpoint restored and verified.

        Returns:
            The restored file (keeping its name), the restored directory tree, or a file
            named ``checkpoint.bin`` holding saved bytes; ``None`` when nothing has been
            committed. Without ``into`` each call restores afresh into a new folder.

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
            path, skipped, pruned = self._load_newest(
                names, None if into is None else Path(os.fspath(into))
            )
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

    def _load_newest(
        self, names: list[str], into: Path | None = None
    ) -> tuple[Path | None, list[str], bool]:
        """Restore the newest intact of ``names``; also report skipped and pruned ones."""
        skipped: list[str] = []
        pruned = False
        for name in reversed(names):
            url = self._store.url_of(f"{CHECKPOINTS}/{name}")
            try:
                manifest = self._read_manifest(name)
                started = time.monotonic()
                path = self._restore(manifest, into)
            except (
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
                warnings.warn(message, TaskpointWarning, stacklevel=3)
                continue
            elapsed = time.monotonic() - started
            log.info(
                "restored %s checkpoint %s (%d bytes) in %.2fs",
                manifest.kind, url, manifest.size, elapsed,
            )
            self._intact.add((manifest.key, manifest.checksum))
            if self._attempt is not None:
                history.record_resume(self._store, self._attempt, manifest, elapsed)
            else:
                self._resumed = (manifest, elapsed)  # recorded once an attempt is claimed
            return path, skipped, pruned
        return None, skipped, pruned

    async def load(self, *, into: str | os.PathLike[str] | None = None) -> Path | None:
        """Async :meth:`load_sync`: the download runs in worker threads."""
        return await asyncio.to_thread(functools.partial(self.load_sync, into=into))

    def _restore_dir(self, manifest: Manifest) -> Path:
        try:
            if self._workdir is None:
                self._workdir = Path(tempfile.mkdtemp(prefix="taskpoint-restore-"))
                _workdirs.append(str(self._workdir))
            target = self._workdir / f"{manifest.attempt:06d}-{manifest.seq:09d}-{next(self._loads)}"
            target.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            where = str(self._workdir or tempfile.gettempdir())
            raise _restore_error(exc, where) from exc
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
                if _is_local_write_error(exc, path):
                    raise _restore_error(exc, str(path)) from exc
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
            raise _restore_error(exc, str(into)) from exc

    def _restore(self, manifest: Manifest, into: Path | None = None) -> Path:
        key = f"{CHECKPOINTS}/{manifest.payload}"
        url = self._store.url_of(key)
        staging = self._restore_dir(manifest) if into is None else self._staging_in(into)
        path = staging / (manifest.name or BYTES_NAME)
        try:
            if manifest.is_tree:
                tree.restore_tree(
                    self._store, manifest, path, existing=into, progress=self._progress,
                    workers=max(16, self._store.transfer.concurrency),
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
            if exc.__cause__ is not None and _is_local_write_error(exc.__cause__, staging):
                raise _restore_error(exc.__cause__, str(path)) from exc
            raise
        except FileNotFoundError:  # the payload is missing from the store
            shutil.rmtree(staging, ignore_errors=True)
            raise
        except OSError as exc:  # reading back what was written: the local disk's fault
            shutil.rmtree(staging, ignore_errors=True)
            raise _restore_error(exc, str(path)) from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if into is None:
            return path
        try:
            if manifest.kind == "directory":
                tree.swap_into(path, into)
                return into
            os.replace(path, into / path.name)
            return into / path.name
        except OSError as exc:
            raise _restore_error(exc, str(into)) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""Errors only a write can meet: a full disk or quota, a file over the size limit."""
_REFUSED_ERRNOS = {
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
    errno.EMFILE, errno.ENFILE, errno.EIO,
}
"""Errors that are the restore directory's when they name a path inside it."""


def _is_local_write_error(exc: BaseException, staging: Path) -> bool:
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


def _restore_error(exc: BaseException, path: str) -> CheckpointRestoreError:
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    where = getattr(exc, "filename", None) or path
    return CheckpointRestoreError(
        f"cannot restore the checkpoint to local disk: writing {where} failed: {cause} "
        f"({type(exc).__name__}). The checkpoint in the store is intact and untouched; "
        "free space or fix the restore directory (workdir=), then load again",
        path=str(where),
    )


Snapshot = Literal["copy", "link"]


def _check_snapshot(snapshot: object) -> None:
    if snapshot not in ("copy", "link"):
        raise ValueError(f'snapshot must be "copy" or "link"; got {snapshot!r}')


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def _snapshot(source: _Source, how: Snapshot = "copy") -> _Source:
    """A private snapshot of ``source`` that later changes to the original cannot reach.

    ``how="link"`` hard-links files (see :meth:`Checkpoint.save_sync`); it is placed beside
    the original, on its file system, so links are possible.
    """
    if source.path is None:
        return dataclasses.replace(source, blocked_s=time.monotonic() - source.called)
    near = str(source.path.parent) if how == "link" else None
    try:
        folder = Path(tempfile.mkdtemp(prefix=".taskpoint-snapshot-", dir=near))
    except OSError:  # a read-only parent: a copy in the temporary folder instead
        folder, how = Path(tempfile.mkdtemp(prefix="taskpoint-snapshot-")), "copy"
    target = folder / source.path.name
    copy = _link_or_copy if how == "link" else shutil.copy2
    if source.kind == "directory":
        shutil.copytree(source.path, target, symlinks=True, copy_function=copy)
    else:
        copy(str(source.path), str(target))
    return _Source(
        source.kind, path=target, snapshot=folder, called=source.called,
        blocked_s=time.monotonic() - source.called,
    )


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


def commit_request(request: _uploader.Request) -> tuple[SaveStats, tuple[str, str]]:
    """Commit a background save in the upload process (see :mod:`taskpoint._uploader`).

    Returns:
        The save's stats and its ``(manifest key, checksum)``, for the parent to record.
    """
    checkpoint = Checkpoint(**request.options, attempt=request.attempt)
    checkpoint._intact |= request.intact
    return checkpoint._commit(request.source, request.attempt, request.seq)


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

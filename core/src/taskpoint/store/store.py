"""The store: one checkpoint location on any fsspec filesystem.

:class:`Store` is the face of the store layer, the only code that talks to fsspec. It
resolves a URL to a filesystem lazily (so constructing a checkpoint does no I/O), retries
transient failures with exponential backoff, and translates every other failure into
:class:`~taskpoint.CheckpointStoreError` naming the URL. ``FileNotFoundError`` passes
through unchanged: callers decide what "missing" means.

Writes of small objects (:meth:`Store.write_atomic`) are all-or-nothing: on a local disk
through a temporary file and ``os.replace``, on object stores through a single PUT.

On object stores (S3, GCS, Azure Blob) a payload is first spooled to a local temporary
file, then uploaded with the backend's multipart (S3), resumable (GCS) or block (Azure)
upload, parts in parallel where the backend can (see :mod:`taskpoint.store.transfer`). A
transient failure repeats the upload from the spool, not the producer. After a successful
upload, multipart uploads left behind under the same folder by interrupted saves (S3
in-progress uploads, Azure uncommitted blocks) are aborted, so they are neither billed nor
visible. A bucket or container that does not exist is reported as such, never created, and
never taken for "no checkpoint yet".

The layer's modules, each importing only those listed after it:

- this one: :class:`Store`, each operation one try run under the retry policy;
- :mod:`taskpoint.store._exclusive` (create-if-absent) and
  :mod:`taskpoint.store._payloads` (uploads, downloads, interrupted-upload clean-up): one
  try of what differs by kind of store;
- :mod:`taskpoint.store._location`: the URL, its filesystem, names to paths, the kind of
  store, the missing-bucket check;
- :mod:`taskpoint.store._retry` (:class:`RetryPolicy`, the retry-and-translate loop),
  :mod:`taskpoint.store.transfer` (the backends' transfer knobs) and
  :mod:`taskpoint.store._local_files` (all-or-nothing writes on the local disk);
- :mod:`taskpoint.store._faults`: what a failure means (transient? refused credentials?).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, TypeVar

import fsspec

from taskpoint import _scratch
from taskpoint.errors import CheckpointStoreError
from taskpoint.store import _exclusive, _local_files, _payloads, _retry
from taskpoint.store import transfer as _transfer
from taskpoint.store._faults import is_transient
from taskpoint.store._location import Location, absolute_location, check_location
from taskpoint.store._retry import RetryPolicy
from taskpoint.store._streams import ReadView
from taskpoint.store.transfer import Transfer

__all__ = ["RetryPolicy", "Store", "absolute_location", "check_location", "is_transient"]

T = TypeVar("T")


class Store:
    """A prefix (``url``) on a filesystem, with retrying, error-translating operations.

    Names passed to the methods are ``/``-separated paths relative to ``url``.

    Args:
        url: any fsspec URL or a local path.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        retry: the policy for transient failures. On Azure it also paces the SDK's own
            per-request retries (whose default first wait is 15 s).
        transfer: part size and parallelism of object-store transfers; by default
            :meth:`Transfer.from_env`.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        transfer: Transfer | None = None,
    ) -> None:
        url = check_location("the checkpoint store URL", url)
        options = dict(storage_options or {})
        self._retry = retry or RetryPolicy()
        self._at = Location(
            url.rstrip("/") or url, options, self._retry, transfer or Transfer.from_env()
        )

    @property
    def transfer(self) -> Transfer:
        """The part size and parallelism of this store's transfers."""
        return self._at.transfer

    @property
    def url(self) -> str:
        """The location's URL as given."""
        return self._at.url

    def url_of(self, name: str) -> str:
        """The full URL of ``name`` under this location."""
        return self._at.url_of(name)

    def warm(self) -> threading.Thread | None:
        """Open the store's filesystem and client on a thread, ahead of the first call
        (see :meth:`taskpoint.store._location.Location.warm`); never fails.

        Returns:
            The thread, or ``None`` where nothing needed warming.
        """
        return self._at.warm()

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, created on first use.

        Raises:
            CheckpointStoreError: the URL's protocol is unknown, or its backend is not
                installed or cannot be configured with the given options.
        """
        return self._at.fs

    @property
    def is_local(self) -> bool:
        """Whether the store is the local filesystem."""
        return self._at.is_local

    @property
    def is_memory(self) -> bool:
        """Whether the store is fsspec's in-process ``memory://`` filesystem."""
        return self._at.is_memory

    @property
    def is_object_store(self) -> bool:
        """Whether the store is a bucket (or container) of S3, GCS or Azure Blob."""
        return self._at.is_object_store

    def _call(self, what: str, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` as :func:`taskpoint.store._retry.run` does, retrying transient failures; a
        FileNotFoundError from an object store whose bucket is missing becomes a
        CheckpointStoreError saying so."""
        return _retry.run(self._retry, what, self.url_of(name), fn, self._at.check_bucket)

    def list(self, prefix: str) -> list[str]:
        """Names of the objects directly under ``prefix``; ``[]`` when it does not exist.

        Raises:
            CheckpointStoreError: the store failed, or its bucket does not exist.
        """

        def run() -> list[str]:
            self._at.invalidate(prefix)
            try:
                # detail=False: no per-entry stat, so an entry vanishing mid-listing (a
                # concurrent prune) cannot make the whole prefix look missing.
                entries = self._at.call("ls", self._at.path(prefix), detail=False)
            except FileNotFoundError as exc:
                self._at.check_bucket(exc)
                return []
            return sorted(os.path.basename(str(e).rstrip("/")) for e in entries)

        return self._call("list", prefix, run)

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """The objects directly under ``prefix`` and their sizes; ``{}`` when it is missing.

        Raises:
            CheckpointStoreError: the store failed, or its bucket does not exist.
        """

        def run() -> dict[str, int]:
            self._at.invalidate(prefix)
            try:
                entries = self._at.call("ls", self._at.path(prefix), detail=True)
            except FileNotFoundError as exc:
                self._at.check_bucket(exc)
                return {}
            return {
                os.path.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0)
                for e in entries
                if e.get("type") != "directory"
            }

        return self._call("list", prefix, run)

    def exists(self, name: str) -> bool:
        """Whether ``name`` is an object, a directory or a non-empty prefix.

        Raises:
            CheckpointStoreError: the store failed.
        """
        return bool(self._call("inspect", name, lambda: self._at.call("exists", self._at.path(name))))

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a directory (or, on object stores, a non-empty prefix).

        Raises:
            CheckpointStoreError: the store failed.
        """
        return bool(self._call("inspect", name, lambda: self._at.call("isdir", self._at.path(name))))

    def read_bytes(self, name: str) -> bytes:
        """The whole object ``name``. Raises FileNotFoundError when it does not exist."""
        return self._call("read", name, lambda: _payloads.read(self._at, name))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of the object ``name``: one ranged GET on
        object stores. Fewer bytes come back where the object is shorter. Raises
        FileNotFoundError when it does not exist."""
        return self._call("read", name, lambda: _payloads.read(self._at, name, start, end))

    def local_path(self, name: str) -> str | None:
        """The operating system's path of ``name`` when the store is the local disk, so a
        reader can map it instead of copying it; ``None`` elsewhere."""
        return self._at.path(name) if self.is_local else None

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write ``data`` to ``name`` so readers see either nothing or all of it."""
        self.write_parts(name, [data])

    def write_parts(self, name: str, parts: Sequence[bytes | memoryview]) -> None:
        """:meth:`write_atomic` of the concatenation of ``parts``, which on a local disk
        are written one after another rather than joined first; one part is sent as it
        lies (a ``memoryview`` stays a view on S3), several are joined."""

        def run() -> None:
            self._at.makedirs(name)
            path = self._at.path(name)
            if not self.is_local:
                whole = parts[0] if len(parts) == 1 else b"".join(parts)
                _payloads.write_bytes(self._at, name, whole)
                return
            _local_files.replace(path, parts)

        self._call("write", name, run)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` unless it exists; whether this call created it.

        Atomic on every store, so of two writers racing for one name exactly one wins: on a
        local disk a complete temporary file is hard-linked into place (``link`` fails when
        the name exists), on object stores a conditional write (S3 ``If-None-Match: *``,
        GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``). Readers never see a
        partial object.

        Raises:
            CheckpointStoreError: the store failed, or it cannot write conditionally.
        """
        return self._call("create", name, lambda: _exclusive.create_new(self._at, name, data))

    def write_stream(self, name: str, produce: Callable[[BinaryIO], None]) -> None:
        """Create ``name`` from what ``produce`` writes to the stream it is handed.

        On an object store, ``produce`` runs once into a local spool, which is then
        uploaded (in parallel parts when large); a transient failure uploads the spool
        again. Elsewhere ``produce`` writes straight to the store and runs again on a
        transient failure, so it must be repeatable. A failed write may leave a partial
        object behind; callers write payloads under fresh names and commit them separately.
        After a successful upload to an object store, interrupted multipart uploads in the
        same folder whose names sort at or before ``name`` are aborted.
        """
        if not self.is_object_store:

            def run() -> None:
                self._at.makedirs(name)
                # autocommit: never join an fsspec transaction another thread has open on
                # this shared filesystem instance (Lightning saves every .ckpt in one);
                # its commit would close this file under us.
                with self.fs.open(self._at.path(name), "wb", autocommit=True) as fh:
                    produce(fh)

            self._call("write", name, run)
            return
        spool = _transfer.Spool(self.transfer.part_size)
        try:
            produce(spool)  # type: ignore[arg-type]
            spool.finish()
            self._call("write", name, lambda: _payloads.upload_spool(self._at, spool, name))
        finally:
            spool.discard()
        _payloads.abort_interrupted_uploads(self._at, name)

    def put_file(self, local: str, name: str) -> None:
        """Upload the local file ``local`` to ``name``.

        On object stores: in parallel parts when large, then interrupted uploads are
        cleaned up as by :meth:`write_stream`.
        """

        def run() -> None:
            self._at.makedirs(name)
            _payloads.put(self._at, local, name)

        self._call("upload to", name, run)
        if self.is_object_store:
            _payloads.abort_interrupted_uploads(self._at, name)

    def get_file(self, name: str, local: str) -> None:
        """Download ``name`` to the local path ``local``. Raises FileNotFoundError if missing.

        On object stores in parallel ranged parts where the backend can; a failed
        download is retried whole.
        """
        self._call("download", name, lambda: _payloads.download(self._at, name, local))

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[BinaryIO]:
        """A binary stream over ``name``. Raises FileNotFoundError when it is missing.

        Opening is retried; on an object store the whole object is downloaded first (in
        parallel parts where the backend can), and a failed download is retried. A failure
        while reading raises CheckpointStoreError from the stream's ``read``, so a caller
        can tell a store fault from bad content.
        """
        if self.is_object_store:
            folder = _scratch.owned_folder(_scratch.DOWNLOAD_PREFIX)  # swept if killed
            local = os.path.join(folder, "payload")
            try:
                self._call("download", name, lambda: _payloads.download(self._at, name, local))
                with open(local, "rb") as downloaded:
                    yield _GuardedReader(downloaded, self.url_of(name))  # type: ignore[misc]
            finally:
                _scratch.remove(folder)
            return
        fh: Any
        if self.is_memory:
            fh = self._call(
                "open", name, lambda: io.BytesIO(_payloads.read_memory(self._at, name))
            )
        else:
            fh = self._call("open", name, lambda: self.fs.open(self._at.path(name), "rb"))
        try:
            yield _GuardedReader(fh, self.url_of(name))  # type: ignore[misc]
        finally:
            with contextlib.suppress(Exception):
                fh.close()

    def remove_tree(self, name: str = "") -> None:
        """Delete ``name`` and everything under it; a missing prefix is not an error.

        On object stores, unfinished multipart uploads under it are aborted as well.
        """

        def run() -> None:
            path = self._at.path(name)
            with contextlib.suppress(FileNotFoundError):
                if self._at.call("exists", path):
                    self._at.call("rm", path, recursive=True)
            self._at.invalidate(name)

        self._call("delete", name, run)
        if self.is_object_store:
            _payloads.abort_interrupted_uploads(self._at, name, everything=True)

    def remove(self, name: str) -> None:
        """Delete ``name``; a name that is already gone is not an error."""

        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._at.call("rm_file", self._at.path(name))

        self._call("delete", name, run)


class _GuardedReader(ReadView):
    """Reads from a store stream, translating its failures into CheckpointStoreError."""

    def __init__(self, raw: BinaryIO, url: str) -> None:
        self._raw = raw
        self._url = url

    def read(self, size: int = -1) -> bytes:
        try:
            return self._raw.read(size)
        except Exception as exc:
            raise CheckpointStoreError(
                f"checkpoint store failed while reading {self._url}: {type(exc).__name__}: {exc}",
                url=self._url,
            ) from exc

"""The store: one checkpoint location on any fsspec filesystem.

This is the only module that talks to fsspec. It resolves a URL to a filesystem lazily (so
constructing a checkpoint does no I/O), retries transient failures with exponential backoff,
and translates every other failure into :class:`~taskpoint.CheckpointStoreError` naming
the URL. ``FileNotFoundError`` passes through unchanged: callers decide what "missing" means.

Writes of small objects (:meth:`Store.write_atomic`) are all-or-nothing: on a local disk
through a temporary file and ``os.replace``, on object stores through a single PUT.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from taskpoint.errors import CheckpointError, CheckpointStoreError

__all__ = ["RetryPolicy", "Store"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EINVAL}


class RetryPolicy:
    """How store calls retry transient failures.

    Args:
        attempts: total tries per call (1 disables retrying).
        initial: seconds to wait before the first retry; doubles each retry.
        maximum: the longest wait between tries, in seconds.
    """

    def __init__(self, attempts: int = 5, initial: float = 0.2, maximum: float = 5.0) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1; got {attempts!r}")
        self.attempts = attempts
        self.initial = initial
        self.maximum = maximum

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return float(min(self.maximum, self.initial * (2**retry)))


def is_transient(exc: BaseException) -> bool:
    """Whether a failed store call is worth repeating.

    Connection resets, timeouts and generic I/O errors (what fsspec backends raise for
    HTTP 5xx and throttling) are transient; missing objects, refused permissions, full or
    read-only disks and every non-``OSError`` exception are not.
    """
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    return type(exc).__name__ in {"ClientOSError", "ServerDisconnectedError", "ClientPayloadError"}


class Store:
    """A prefix (``url``) on a filesystem, with retrying, error-translating operations.

    Names passed to the methods are ``/``-separated paths relative to ``url``.

    Args:
        url: any fsspec URL or a local path.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        retry: the policy for transient failures.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._url = url.rstrip("/") or url
        self._options = dict(storage_options or {})
        self._retry = retry or RetryPolicy()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._base = ""

    @property
    def url(self) -> str:
        """The location's URL as given."""
        return self._url

    def url_of(self, name: str) -> str:
        """The full URL of ``name`` under this location."""
        return f"{self._url}/{name}" if name else self._url

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, created on first use.

        Raises:
            CheckpointStoreError: the URL's protocol is unknown, or its backend is not
                installed or cannot be configured with the given options.
        """
        if self._fs is None:
            try:
                fs, base = fsspec.core.url_to_fs(self._url, **self._options)
            except ImportError as exc:
                raise CheckpointStoreError(
                    f"cannot open checkpoint store {self._url}: {exc}", url=self._url
                ) from exc
            except Exception as exc:
                raise CheckpointStoreError(
                    f"cannot open checkpoint store {self._url}: {exc} (is the URL right? any "
                    "fsspec URL such as file://, memory://, s3://, gs:// or az:// works)",
                    url=self._url,
                ) from exc
            self._fs, self._base = fs, base.rstrip("/")
        return self._fs

    @property
    def is_local(self) -> bool:
        """Whether the store is the local filesystem."""
        return isinstance(self.fs, LocalFileSystem)

    def _path(self, name: str) -> str:
        fs = self.fs
        return f"{self._base}/{name}" if name else self._base or fs.root_marker

    def _call(self, what: str, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures; translate all but FileNotFoundError."""
        url = self.url_of(name)
        for retry in range(self._retry.attempts):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except CheckpointError:
                raise
            except Exception as exc:
                last = retry == self._retry.attempts - 1
                if not is_transient(exc) or last:
                    tries = f" after {retry + 1} tries" if retry else ""
                    raise CheckpointStoreError(
                        f"checkpoint store failed to {what} {url}{tries}: "
                        f"{type(exc).__name__}: {exc}",
                        url=url,
                    ) from exc
                delay = self._retry.delay(retry)
                log.warning(
                    "transient store error on %s %s (%s: %s); retrying in %.1fs",
                    what, url, type(exc).__name__, exc, delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _invalidate(self, name: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self._path(name))

    def _makedirs(self, name: str) -> None:
        if self.is_local:
            parent = os.path.dirname(self._path(name))
            self.fs.makedirs(parent, exist_ok=True)

    def list(self, prefix: str) -> list[str]:
        """Names of the objects directly under ``prefix``; ``[]`` when it does not exist."""

        def run() -> list[str]:
            self._invalidate(prefix)
            try:
                # detail=False: no per-entry stat, so an entry vanishing mid-listing (a
                # concurrent prune) cannot make the whole prefix look missing.
                entries = self.fs.ls(self._path(prefix), detail=False)
            except FileNotFoundError:
                return []
            return sorted(os.path.basename(str(e).rstrip("/")) for e in entries)

        return self._call("list", prefix, run)

    def read_bytes(self, name: str) -> bytes:
        """The whole object ``name``. Raises FileNotFoundError when it does not exist."""
        return self._call("read", name, lambda: bytes(self.fs.cat_file(self._path(name))))

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write ``data`` to ``name`` so readers see either nothing or all of it."""

        def run() -> None:
            self._makedirs(name)
            path = self._path(name)
            if self.is_local:
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                try:
                    with open(tmp, "wb") as fh:
                        fh.write(data)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
            else:
                self.fs.pipe_file(path, data)

        self._call("write", name, run)

    def write_stream(self, name: str, produce: Callable[[BinaryIO], None]) -> None:
        """Create ``name`` from what ``produce`` writes to the stream it is handed.

        On a transient failure the whole object is produced again, so ``produce`` must be
        repeatable. A failed write may leave a partial object behind; callers write
        payloads under fresh names and commit them separately.
        """

        def run() -> None:
            self._makedirs(name)
            with self.fs.open(self._path(name), "wb") as fh:
                produce(fh)

        self._call("write", name, run)

    def put_file(self, local: str, name: str) -> None:
        """Upload the local file ``local`` to ``name``."""

        def run() -> None:
            self._makedirs(name)
            self.fs.put_file(local, self._path(name))

        self._call("upload to", name, run)

    def get_file(self, name: str, local: str) -> None:
        """Download ``name`` to the local path ``local``. Raises FileNotFoundError if missing."""
        self._call("download", name, lambda: self.fs.get_file(self._path(name), local))

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[BinaryIO]:
        """A binary stream over ``name``. Raises FileNotFoundError when it is missing.

        Opening is retried. A failure while reading raises CheckpointStoreError from the
        stream's ``read``, so a caller can tell a store fault from bad content.
        """
        fh = self._call("open", name, lambda: self.fs.open(self._path(name), "rb"))
        try:
            yield _GuardedReader(fh, self.url_of(name))  # type: ignore[misc]
        finally:
            with contextlib.suppress(Exception):
                fh.close()

    def size(self, name: str) -> int:
        """The size of ``name`` in bytes. Raises FileNotFoundError when it is missing."""
        return self._call("stat", name, lambda: int(self.fs.size(self._path(name))))

    def remove_tree(self, name: str = "") -> None:
        """Delete ``name`` and everything under it; a missing prefix is not an error."""

        def run() -> None:
            path = self._path(name)
            with contextlib.suppress(FileNotFoundError):
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)
            self._invalidate(name)

        self._call("delete", name, run)

    def remove(self, name: str) -> None:
        """Delete ``name``; a name that is already gone is not an error."""

        def run() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._path(name))

        self._call("delete", name, run)


class _GuardedReader:
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

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        """Does nothing: :meth:`Store.open_read` closes the stream."""

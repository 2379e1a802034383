"""Where a store is: its URL, the fsspec filesystem behind it, and the paths in it.

With :mod:`taskpoint.store.store` and :mod:`taskpoint.store.transfer`, the store layer: the only
modules that talk to fsspec. A :class:`Location` opens its filesystem on first use (so
constructing a checkpoint does no I/O), pinning the bucket protocols to the backends fsspec
documents for them; it maps names to the filesystem's paths, tells which kind of store it
is, and tells a missing bucket from a missing object.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import known_implementations

from taskpoint.errors import CheckpointStoreError
from taskpoint.store import _watchdog
from taskpoint.store import transfer as _transfer
from taskpoint.store._retry import RetryPolicy
from taskpoint.store._watchdog import Progress
from taskpoint.store.transfer import Transfer

__all__ = ["Location", "check_location"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
"""Protocols whose stores are buckets or containers of an object store."""

_PINNED_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
"""Protocols resolved to fsspec's own backend even when another library re-registered them."""


_NOT_MEMORY = frozenset({None, "file", "local", *_PINNED_PROTOCOLS})
"""Protocols whose stores are never fsspec's ``memory://``, whatever is registered."""


def _url_to_fs(url: str, options: Mapping[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """Open ``url``'s filesystem, with s3fs / gcsfs / adlfs for their protocols.

    Libraries can replace fsspec's handler for a protocol process-wide (``flyte.init()``
    registers obstore for ``s3``, ``gs`` and ``abfs``), which would change what
    ``storage_options`` mean under taskpoint's feet; bucket protocols therefore go to the
    backend fsspec documents for them.
    """
    protocol = fsspec.core.split_protocol(url)[0]
    known = known_implementations.get(protocol or "")
    if protocol not in _PINNED_PROTOCOLS or known is None:
        return fsspec.core.url_to_fs(url, **options)  # type: ignore[no-any-return]
    module_name, _, class_name = known["class"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        hint = known.get("err") or f"install {module_name.split('.')[0]}"
        raise ImportError(f"{protocol}:// needs {module_name}: {hint}") from exc
    kwargs = {**cls._get_kwargs_from_urls(url), **options}
    return cls(**kwargs), cls._strip_protocol(url)


def check_location(what: str, value: object) -> str:
    """Return ``value`` if it can name a store location: a non-blank string or path.

    A blank location would otherwise resolve to the working directory or, stripped of its
    slashes, to the file-system root.

    Raises:
        TypeError: ``value`` is not a str or os.PathLike.
        ValueError: ``value`` is empty or only whitespace (``what`` names it).
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or os.PathLike; got {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"{what} is blank ({text!r}): give a local path or an fsspec URL such as "
            "s3://bucket/prefix"
        )
    return text


def absolute_location(url: str) -> str:
    """``url`` with a relative local path made absolute against the working directory now
    (``runs/a`` becomes ``/cwd/runs/a``; ``file://runs/a``, ``file:///cwd/runs/a``), so
    that it names the same folder from any process and after a ``chdir``; other URLs are
    returned as given."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol not in (None, "file", "local") or os.path.isabs(path):
        return url
    absolute = os.path.abspath(path)
    return absolute if protocol is None else f"{protocol}://{absolute}"


class Location:
    """A prefix (``url``) on an fsspec filesystem, opened on first use.

    Names are ``/``-separated paths relative to ``url``.

    Args:
        url: any fsspec URL or a local path, already checked by :func:`check_location`
            and without a trailing slash.
        options: passed to the fsspec filesystem (credentials, endpoint, ...).
        retry: the store's retry policy; it paces Azure's own per-request retries.
        transfer: part size and parallelism of transfers to and from the location; set
            on backends that take them only at construction (see
            :func:`taskpoint.store.transfer.tune_backend`).
    """

    def __init__(
        self, url: str, options: Mapping[str, Any], retry: RetryPolicy, transfer: Transfer
    ) -> None:
        self._url = url
        self._options = options
        self._retry = retry
        self._transfer = transfer
        self._fs: fsspec.AbstractFileSystem | None = None
        self._base = ""
        self._bucket_ok = False

    @property
    def transfer(self) -> Transfer:
        """The part size and parallelism of transfers to and from the location."""
        return self._transfer

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
                fs, base = _url_to_fs(self._url, self._options)
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
            _transfer.tune_backend(fs, self._transfer, self._retry.attempts - 1, self._retry.delay)
        return self._fs

    def warm(self) -> threading.Thread | None:
        """Open the filesystem and its client on a thread, so that the first call finds
        them ready: on an object store, importing the backend (s3fs with aiobotocore and
        aiohttp: about a second of CPU) and building its client (botocore's service model)
        is the first call's largest cost. Local and in-memory stores, and one already
        open, need nothing. A failure is left for the first call to raise.

        Returns:
            The thread, or ``None`` where nothing needed warming.
        """
        protocol = fsspec.core.split_protocol(self._url)[0]
        if self._fs is not None or protocol in (None, "file", "local", "memory"):
            return None

        def run() -> None:
            try:
                fs = self.fs
                connect = getattr(fs, "set_session", None)
                if connect is not None and self.is_async:
                    from fsspec.asyn import sync  # imported by the async backends anyway

                    sync(fs.loop, connect)
            except Exception as exc:  # the first real call reports it
                log.debug("%s: opening the store ahead of use failed: %s", self._url, exc)

        thread = threading.Thread(target=run, name="taskpoint-store-warm", daemon=True)
        thread.start()
        return thread

    @property
    def is_local(self) -> bool:
        """Whether the store is the local filesystem."""
        return isinstance(self.fs, LocalFileSystem)

    @property
    def is_memory(self) -> bool:
        """Whether the store is fsspec's in-process ``memory://`` filesystem; told from the
        URL where it names a bucket protocol or the local disk, without opening the
        filesystem (a background save asks before its snapshot: opening an object store
        imports its client library, about a second of CPU)."""
        if self._fs is None and fsspec.core.split_protocol(self._url)[0] in _NOT_MEMORY:
            return False
        return isinstance(self.fs, MemoryFileSystem)

    @property
    def protocols(self) -> set[str]:
        """The filesystem's protocol names (``{"s3", "s3a"}``, ``{"file", "local"}``)."""
        protocol = self.fs.protocol
        return {protocol} if isinstance(protocol, str) else set(protocol)

    @property
    def is_object_store(self) -> bool:
        """Whether the store is a bucket (or container) of S3, GCS or Azure Blob."""
        return bool(self.protocols & _BUCKET_PROTOCOLS)

    @property
    def is_async(self) -> bool:
        """Whether the filesystem runs its calls on an event loop (S3, GCS, Azure, HTTP):
        those calls are watched for stalls (see :meth:`call`). A wrapper that claims to be
        asynchronous over a blocking filesystem (fsspec's ``DirFileSystem`` over a local
        disk) is not: its coroutines would call ones the wrapped filesystem lacks."""
        fs = self.fs
        wrapped = getattr(fs, "fs", None)
        if hasattr(wrapped, "protocol") and not getattr(wrapped, "async_impl", False):
            return False
        return bool(getattr(fs, "async_impl", False)) and getattr(fs, "loop", None) is not None

    @property
    def stall_timeout(self) -> float:
        """Seconds a try may go without moving a byte (the retry policy's)."""
        return self._retry.stall_timeout

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``, abandoned with
        :class:`~taskpoint.store._watchdog.Stalled` after the stall timeout on an
        asynchronous filesystem (where it moves no bytes it can report, the timeout bounds
        the whole call); on the local disk and ``memory://``, a plain call."""
        fs = self.fs
        coroutine = getattr(fs, f"_{method}", None)
        if not self.is_async or coroutine is None:
            return getattr(fs, method)(*args, **kwargs)
        return self.watched(lambda progress: coroutine(*args, **kwargs))

    def watched(self, start: Callable[[Progress], Coroutine[Any, Any, T]]) -> T:
        """Run ``start(progress)`` on the asynchronous filesystem's event loop, abandoning
        it once ``progress`` has not ticked for the stall timeout (see
        :func:`taskpoint.store._watchdog.run`)."""
        return _watchdog.run(self.fs.loop, start, self._retry.stall_timeout)

    def path(self, name: str) -> str:
        """The filesystem's path of ``name`` (of the location itself when ``name`` is empty)."""
        fs = self.fs
        return f"{self._base}/{name}" if name else self._base or fs.root_marker

    def check_bucket(self, cause: BaseException) -> None:
        """Raise CheckpointStoreError, from ``cause``, if this object store's bucket does not
        exist; return where it exists, where it cannot be told, and off object stores.

        Once seen, the bucket is taken to exist from then on.
        """
        if self._bucket_ok or not self.is_object_store:
            return
        bucket = self._base.split("/", 1)[0]
        if not bucket:
            return
        try:
            with contextlib.suppress(Exception):
                self.fs.invalidate_cache(bucket)
            exists = bool(self.call("exists", bucket))
        except Exception:  # cannot tell: let the original error speak
            return
        if exists:
            self._bucket_ok = True
            return
        raise CheckpointStoreError(
            f"checkpoint store {self._url} is unusable: bucket {bucket!r} does not exist "
            "(taskpoint never creates buckets or containers: create it, or fix the URL "
            "or the endpoint)",
            url=self._url,
        ) from cause

    def invalidate(self, name: str) -> None:
        """Forget what the filesystem cached about ``name``; never fails."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.path(name))

    def makedirs(self, name: str) -> None:
        """On a local disk, create the folders ``name`` goes in; elsewhere nothing."""
        if self.is_local:
            parent = os.path.dirname(self.path(name))
            self.fs.makedirs(parent, exist_ok=True)

"""Moving large objects to and from object stores: settings, spooling, parts, clean-up.

:class:`~taskpoint.store.store.Store` delegates here for payloads on S3, GCS and Azure Blob; this
module knows the backends' transfer knobs but nothing of retries or of taskpoint's errors,
which stay in :mod:`taskpoint.store.store`:

- :class:`Transfer`: part size and parallelism, from the environment by default.
- :class:`Spool`: a payload is written to memory (up to one part) or a temporary file
  first, so a transient failure uploads the spool again rather than re-running the
  producer.
- :func:`put` / :func:`get`: one upload or download through the backend's multipart (S3),
  resumable (GCS) or block (Azure) transfer, sized by :func:`part_options`.
- :func:`abort_interrupted_uploads`: unfinished multipart uploads (S3) and uncommitted
  blocks (Azure) left by interrupted saves are aborted, so they are neither billed nor
  visible. GCS resumable sessions cannot be listed; they expire within a week.
- :func:`tune_backend`: Azure's SDK takes its block size and retry pacing only from its
  built client, so they are set there.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from taskpoint.store._streams import WriteView

__all__ = [
    "LostUpload",
    "Spool",
    "Transfer",
    "abort_interrupted_uploads",
    "get",
    "part_options",
    "put",
    "tune_backend",
]

log = logging.getLogger(__name__)

_MIN_S3_PART = 5 * 2**20
_S3_MAX_PARTS = 10_000
_GCS_CHUNK = 256 * 2**10
_S3 = frozenset({"s3", "s3a"})
_GCS = frozenset({"gs", "gcs"})
_AZURE = frozenset({"az", "abfs", "abfss"})


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number; got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1; got {raw!r}")
    return value


@dataclass(frozen=True)
class Transfer:
    """How payloads move to and from object stores.

    Args:
        part_size: bytes per multipart part (S3: at least 5 MiB, and larger where an object
            would need more than S3's 10,000 parts; GCS: rounded to 256 KiB; Azure: block
            size and the largest single PUT). Objects of two parts or more upload in parts.
        concurrency: parts moved at once (S3 and Azure; GCS uploads sequentially).

    A transfer holds about ``part_size * concurrency`` bytes in memory, twice that while
    the backend copies or signs them. The defaults come from ``TASKPOINT_PART_SIZE`` and
    ``TASKPOINT_TRANSFER_CONCURRENCY`` when set (see :meth:`from_env`), else 8 MiB and 8:
    about 128 MiB in flight, and S3 objects up to 78 GiB before parts grow.

    Raises:
        ValueError: ``part_size`` or ``concurrency`` is below 1.
    """

    part_size: int = 8 * 2**20
    concurrency: int = 8

    def __post_init__(self) -> None:
        if self.part_size < 1:
            raise ValueError(f"part_size must be at least 1 byte; got {self.part_size!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1; got {self.concurrency!r}")

    def s3_part_size(self, size: int | None = None) -> int:
        """The part size for an S3 object of ``size`` bytes: :attr:`part_size`, raised to
        S3's 5 MiB minimum and to the smallest size that fits the object in 10,000 parts."""
        part = max(self.part_size, _MIN_S3_PART)
        if size is not None and size > part * _S3_MAX_PARTS:
            part = -(-size // _S3_MAX_PARTS)
        return part

    @classmethod
    def from_env(cls) -> Transfer:
        """The settings from ``TASKPOINT_PART_SIZE`` / ``TASKPOINT_TRANSFER_CONCURRENCY``.

        Raises:
            ValueError: a variable is set to something other than a positive integer.
        """
        default = cls()
        return cls(
            part_size=_env_int("TASKPOINT_PART_SIZE", default.part_size),
            concurrency=_env_int("TASKPOINT_TRANSFER_CONCURRENCY", default.concurrency),
        )


def part_options(
    protocols: set[str], transfer: Transfer, size: int | None = None
) -> dict[str, Any]:
    """The backend's transfer keywords for an object of ``size`` bytes (if known).

    Args:
        protocols: the filesystem's protocol names (``{"s3", "s3a"}``, say).
        transfer: the part size and parallelism to apply.
        size: the object's size in bytes, where known (S3 parts grow to fit it).
    """
    part, concurrency = transfer.part_size, transfer.concurrency
    if protocols & _S3:
        return {"chunksize": transfer.s3_part_size(size), "max_concurrency": concurrency}
    if protocols & _GCS:
        return {"chunksize": max(_GCS_CHUNK, part - part % _GCS_CHUNK)}
    if protocols & _AZURE:
        return {"max_concurrency": concurrency}
    return {}


def put(fs: Any, protocols: set[str], transfer: Transfer, local: str, path: str) -> None:
    """Upload the local file ``local`` to ``path`` on ``fs``, in parallel parts when large.

    No retrying and no error translation: the store's caller does both.
    """
    fs.put_file(local, path, **part_options(protocols, transfer, os.path.getsize(local)))


def get(fs: Any, protocols: set[str], transfer: Transfer, path: str, local: str) -> None:
    """Download ``path`` on ``fs`` to the local file ``local``, in ranged parts where the
    backend can (GCS downloads take no part keywords).

    No retrying and no error translation: the store's caller does both.
    """
    options = {} if protocols & _GCS else part_options(protocols, transfer)
    fs.get_file(path, local, **options)


def tune_backend(
    fs: Any, transfer: Transfer, retries: int, delay: Callable[[int], float]
) -> None:
    """Fit the backend to the transfer and retry settings where it allows.

    Azure's SDK takes its block size and retry policy only when its client is built,
    which adlfs does without passing them on: they are set on the built client.
    Other backends are left as they are.

    Args:
        fs: the fsspec filesystem.
        transfer: the part size to use as Azure's block size and largest single PUT.
        retries: how many times the SDK may retry a request itself.
        delay: seconds to wait before retry number ``n`` (0-based).
    """
    if type(fs).__name__ != "AzureBlobFileSystem":
        return
    clients = getattr(fs, "service_client", None)
    for client in clients if isinstance(clients, list) else [clients]:
        config = getattr(client, "_config", None)
        if config is None:
            continue
        part = transfer.part_size
        for attr in ("max_single_put_size", "max_block_size"):
            if hasattr(config, attr):
                setattr(config, attr, part)
        policy = getattr(config, "retry_policy", None)
        if policy is None or not hasattr(policy, "get_backoff_time"):
            continue
        for attr in ("total_retries", "connect_retries", "read_retries", "status_retries"):
            if hasattr(policy, attr):
                setattr(policy, attr, retries)
        policy.get_backoff_time = _backoff(delay)


def _backoff(delay: Callable[[int], float]) -> Callable[[dict[str, Any]], float]:
    """Azure's ``get_backoff_time`` following ``delay`` (its count starts at 1)."""

    def backoff(settings: dict[str, Any]) -> float:
        return delay(max(0, int(settings.get("count", 1)) - 1))

    return backoff


def abort_interrupted_uploads(
    fs: Any, protocols: set[str], prefix: str, last: str | None, where: str
) -> None:
    """Abort unfinished multipart uploads under ``prefix`` whose names sort at or before
    ``last``.

    Names in a folder are ordered oldest first, so those uploads belong to saves that
    were interrupted or superseded; later names may be another writer's, in flight.
    With ``last=None`` every unfinished upload under ``prefix`` goes. Best effort: a
    failure is logged (naming ``where``, the folder's URL), never raised.

    Args:
        fs: the fsspec filesystem.
        protocols: its protocol names.
        prefix: the folder's path on ``fs``, ending in ``/``.
        last: the newest name (relative to ``prefix``) whose uploads may be aborted.
        where: the folder's URL, for messages.
    """
    try:
        if protocols & _S3:
            aborted = _abort_s3_uploads(fs, prefix, last)
        elif protocols & _AZURE:
            aborted = _abort_azure_blocks(fs, prefix, last)
        else:
            return  # GCS: resumable sessions cannot be listed; they expire in a week
    except Exception as exc:
        log.warning(
            "could not clean up interrupted uploads under %s: %s: %s",
            where, type(exc).__name__, exc,
        )
        return
    for key in aborted:
        log.info("aborted interrupted upload %s", key)


def _stale(rest: str, last: str | None) -> bool:
    return last is None or ("/" not in rest and rest <= last)


def _abort_s3_uploads(fs: Any, prefix: str, last: str | None) -> builtins.list[str]:
    bucket, _, key_prefix = prefix.partition("/")
    listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix)
    aborted = []
    for upload in listing.get("Uploads", []):
        key = upload["Key"]
        if _stale(key[len(key_prefix):], last):
            fs.call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"]
            )
            aborted.append(f"{bucket}/{key}")
    return aborted


def _abort_azure_blocks(fs: Any, prefix: str, last: str | None) -> builtins.list[str]:
    from fsspec.asyn import sync

    container, _, blob_prefix = prefix.partition("/")

    async def run() -> builtins.list[str]:
        client = fs.service_client.get_container_client(container)
        every = {
            blob.name
            async for blob in client.list_blobs(
                name_starts_with=blob_prefix, include=["uncommittedblobs"]
            )
        }
        committed = {
            blob.name async for blob in client.list_blobs(name_starts_with=blob_prefix)
        }
        aborted = []
        for blob in sorted(every - committed):
            if _stale(blob[len(blob_prefix):], last):
                # Uncommitted blocks go when a block list is committed; then delete.
                blob_client = client.get_blob_client(blob)
                await blob_client.commit_block_list([])
                await blob_client.delete_blob()
                aborted.append(f"{container}/{blob}")
        return aborted

    return builtins.list(sync(fs.loop, run))


class LostUpload(ConnectionError):
    """An object store no longer knows an upload it had begun: worth starting over.

    A ``ConnectionError``, so :func:`taskpoint.store.store.is_transient` retries it.
    """


class Spool(WriteView):
    """A write-only stream kept in memory up to ``limit`` bytes, then in a temporary file.

    Args:
        limit: the most bytes held in memory, in bytes; beyond it everything moves to a
            temporary file, whose name is :attr:`path`.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._memory: io.BytesIO | None = io.BytesIO()
        self._file: BinaryIO | None = None
        self.path: str | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns how many bytes were written."""
        if self._memory is not None:
            if self._memory.tell() + len(data) <= self._limit:
                return self._memory.write(data)
            fd, self.path = tempfile.mkstemp(prefix="taskpoint-upload-")
            self._file = os.fdopen(fd, "wb")
            self._file.write(self._memory.getbuffer())
            self._memory = None
        assert self._file is not None
        return self._file.write(data)

    @property
    def data(self) -> bytes:
        """The spooled bytes, while they are in memory."""
        assert self._memory is not None
        return self._memory.getvalue()

    def finish(self) -> None:
        """Flush what was written to the file, if any."""
        if self._file is not None:
            self._file.close()

    def discard(self) -> None:
        """Close and delete the temporary file, if any."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def flush(self) -> None:
        """Nothing to do: :meth:`Store.write_stream` finishes the spool."""

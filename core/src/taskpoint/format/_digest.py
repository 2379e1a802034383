"""Checksumming stream wrappers: payloads are hashed as they stream, never re-read."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import xxhash

from taskpoint.store._streams import ReadView, WriteView

CHUNK = 8 * 1024 * 1024
"""Bytes moved per read/write call when copying payloads."""


ALGORITHM = "xxh3-128"
"""The checksum new manifests record. Manifests with ``sha256:`` checksums still verify."""


class Digest:
    """A running checksum and byte count, reported as ``<algorithm>:<hex>``.

    XXH3-128 by default: an integrity check (not a signature) fast enough (~10 GB/s) that
    hashing never bounds a transfer.

    Raises:
        ValueError: ``algorithm`` is neither ``xxh3-128`` nor ``sha256``.
    """

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        if algorithm == "xxh3-128":
            self._hash: Any = xxhash.xxh3_128()
        elif algorithm == "sha256":
            self._hash = hashlib.sha256()
        else:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")
        self.algorithm = algorithm
        self.size = 0

    @classmethod
    def matching(cls, checksum: str) -> Digest:
        """A digest of the algorithm that produced ``checksum``."""
        return cls(checksum.partition(":")[0])

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self.size += len(data)

    @property
    def checksum(self) -> str:
        return f"{self.algorithm}:{self._hash.hexdigest()}"


Progress = Callable[[int], object]
"""Called with the number of bytes just moved."""


class HashingWriter(WriteView):
    """A write-only binary stream that hashes what it passes on to ``raw``."""

    def __init__(self, raw: BinaryIO, progress: Progress | None = None) -> None:
        self._raw = raw
        self._progress = progress
        self.digest = Digest()
        self.raw_error: BaseException | None = None
        """What ``raw`` last raised, so a caller can tell its errors from its source's."""

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.digest.update(data)
        if self._progress is not None:
            self._progress(len(data))
        try:
            self._raw.write(data)
        except BaseException as exc:
            self.raw_error = exc
            raise
        return len(data)

    def flush(self) -> None:
        try:
            self._raw.flush()
        except BaseException as exc:
            self.raw_error = exc
            raise


class HashingReader(ReadView):
    """A read-only binary stream that hashes what it reads from ``raw``."""

    def __init__(
        self, raw: BinaryIO, progress: Progress | None = None, digest: Digest | None = None
    ) -> None:
        self._raw = raw
        self._progress = progress
        self.digest = digest or Digest()

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self.digest.update(data)
        if self._progress is not None and data:
            self._progress(len(data))
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        """Read to the end, so the digest covers the whole object."""
        while self.read(CHUNK):
            pass


def file_chunks(path: str) -> Iterator[memoryview]:
    """The local file at ``path`` in :data:`CHUNK`-sized views of one reused buffer.

    Each view is valid only until the next one is taken.
    """
    with open(path, "rb", buffering=0) as fh:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while n := fh.readinto(buffer):
            yield view[:n]


def digest_file(path: str, algorithm: str = ALGORITHM, progress: Progress | None = None) -> Digest:
    """The digest of the local file at ``path``, read in :data:`CHUNK`-sized pieces."""
    digest = Digest(algorithm)
    for chunk in file_chunks(path):
        digest.update(chunk)
        if progress is not None:
            progress(len(chunk))
    return digest

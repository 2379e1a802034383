"""Checksumming stream wrappers: payloads are hashed as they stream, never re-read."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import BinaryIO

CHUNK = 8 * 1024 * 1024
"""Bytes moved per read/write call when copying payloads."""


class Digest:
    """A running SHA-256 and byte count, reported as ``sha256:<hex>``."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self.size += len(data)

    @property
    def checksum(self) -> str:
        return "sha256:" + self._hash.hexdigest()


Progress = Callable[[int], object]
"""Called with the number of bytes just moved."""


class HashingWriter:
    """A write-only binary stream that hashes what it passes on to ``raw``."""

    def __init__(self, raw: BinaryIO, progress: Progress | None = None) -> None:
        self._raw = raw
        self._progress = progress
        self.digest = Digest()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.digest.update(data)
        if self._progress is not None:
            self._progress(len(data))
        self._raw.write(data)
        return len(data)

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        """Does nothing: the owner of ``raw`` closes it."""


class HashingReader:
    """A read-only binary stream that hashes what it reads from ``raw``."""

    def __init__(self, raw: BinaryIO, progress: Progress | None = None) -> None:
        self._raw = raw
        self._progress = progress
        self.digest = Digest()

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

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        """Does nothing: the owner of ``raw`` closes it."""


def copy_stream(src: BinaryIO, dst: BinaryIO) -> None:
    """Copy ``src`` to ``dst`` in :data:`CHUNK`-sized pieces until ``src`` is exhausted."""
    while chunk := src.read(CHUNK):
        dst.write(chunk)

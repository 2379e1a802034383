"""Format 1: a checkpoint as one payload object, beside format 2's trees.

A format-1 checkpoint is one object under ``checkpoints/``: saved bytes, a file stored
as-is, or a directory packed into one compressed tar archive
(:func:`taskpoint.format.archive.pack_directory`). :func:`write_payload` writes it,
hashing what it streams; :func:`restore_payload` brings it back (a download, or an archive
streamed through :func:`taskpoint.format.archive.unpack_directory`) and checks it against
its manifest. Format 2 has the same two sides in :mod:`taskpoint.format._tree_save` and
:mod:`taskpoint.format._tree_restore`; the checkpoint layer picks one by the manifest.

Example::

    digest, name, codec = write_payload(store, "checkpoints/p", kind="bytes", data=b"x")
    restore_payload(store, manifest, Path("restored/checkpoint.bin"))
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO

from taskpoint.errors import (
    CheckpointCorruptError,
    CheckpointSaveError,
    CheckpointStoreError,
    CheckpointUnsafeError,
)
from taskpoint.format import archive
from taskpoint.format._digest import (
    Digest,
    HashingReader,
    HashingWriter,
    Progress,
    digest_file,
    file_chunks,
)
from taskpoint.format.manifest import CHECKPOINTS, Codec, Manifest
from taskpoint.store.store import Store

__all__ = ["is_local_write_error", "restore_payload", "write_payload"]


def write_payload(
    store: Store,
    target: str,
    *,
    kind: str,
    data: bytes | None = None,
    path: Path | None = None,
    codec: Codec = "gzip",
    progress: Progress | None = None,
) -> tuple[Digest, str | None, Codec]:
    """Write one format-1 payload to ``target`` (a key of ``store``).

    Args:
        kind: ``"bytes"`` (``data``), ``"file"`` or ``"directory"`` (``path``).
        codec: how a directory's archive is compressed (bytes and files are stored as-is).
        progress: called with the number of payload bytes moved.

    Returns:
        The digest of what was stored, the name to restore it under (``path``'s) and the
        codec it was stored with.

    Raises:
        CheckpointStoreError: the store failed.
        CheckpointSaveError: ``path`` (or a file under it) could not be read; nothing
            was committed.
        CheckpointUnsafeError: the directory holds an entry an archive cannot keep.
    """
    name = path.name if path is not None else None
    if kind == "file" and store.is_object_store:
        # The backend's own parallel multipart upload, after hashing the file. A file
        # changed while it uploads fails verification at load.
        assert path is not None
        digest = digest_file(str(path))
        store.put_file(str(path), target)
        if progress is not None:
            progress(digest.size)
        return digest, name, "none"
    box: dict[str, HashingWriter] = {}

    def produce(raw: BinaryIO) -> None:
        writer = box["w"] = HashingWriter(raw, progress)
        try:
            if kind == "bytes":
                assert data is not None
                writer.write(data)
            elif kind == "file":
                # One pass that hashes as it copies: as fast as a kernel copy on local
                # disks, where reading the file twice to hash it would cost a third more.
                assert path is not None
                for chunk in file_chunks(str(path)):
                    writer.write(chunk)
            else:
                assert path is not None
                archive.pack_directory(path, writer, codec)  # type: ignore[arg-type]
        except OSError as exc:
            if exc is writer.raw_error:
                raise  # the store's: retried and reported as the store's
            # The source's: reading it again would fail again, and the store is not at fault.
            raise CheckpointSaveError(
                f"could not read {path} to save it to {store.url} "
                f"({type(exc).__name__}: {exc}); nothing was committed",
                url=store.url,
            ) from exc

    store.write_stream(target, produce)
    return box["w"].digest, name, codec if kind == "directory" else "none"


def restore_payload(
    store: Store, manifest: Manifest, path: Path, progress: Progress | None = None
) -> None:
    """Restore the format-1 checkpoint ``manifest`` commits to ``path`` (which must not
    exist): its file, bytes or directory, checked against the manifest's size and checksum.

    Raises:
        CheckpointCorruptError: the payload does not match its manifest, or does not
            decode as a directory archive.
        CheckpointUnsafeError: the archive holds an unsafe entry.
        CheckpointStoreError: the store failed.
        FileNotFoundError: the payload is missing from the store.
        OSError: the local disk refused what was written (see :func:`is_local_write_error`).
    """
    key = f"{CHECKPOINTS}/{manifest.payload}"
    url = store.url_of(key)
    if manifest.kind == "directory":
        digest = _unpack(store, key, url, manifest, path, progress)
    else:
        store.get_file(key, str(path))
        digest = digest_file(str(path), Digest.matching(manifest.checksum).algorithm)
        if progress is not None:
            progress(digest.size)
    if digest.size != manifest.size or digest.checksum != manifest.checksum:
        raise CheckpointCorruptError(
            f"payload {url} does not match its manifest: {digest.size} bytes with "
            f"{digest.checksum}, expected {manifest.size} bytes with {manifest.checksum}",
            url=url,
        )


def _unpack(
    store: Store, key: str, url: str, manifest: Manifest, path: Path, progress: Progress | None
) -> Digest:
    """Stream the archive at ``key`` into ``path``; the digest of what was read."""
    with store.open_read(key) as raw:
        reader = HashingReader(raw, progress, Digest.matching(manifest.checksum))
        try:
            archive.unpack_directory(reader, path, manifest.codec)  # type: ignore[arg-type]
            reader.drain()
        except (CheckpointStoreError, CheckpointUnsafeError):
            raise
        except Exception as exc:
            if is_local_write_error(exc, path):
                raise  # the local disk's, not the checkpoint's
            raise CheckpointCorruptError(
                f"payload {url} cannot be decoded as a directory archive "
                f"({type(exc).__name__}: {exc})",
                url=url,
            ) from exc
    return reader.digest


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

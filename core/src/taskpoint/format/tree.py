"""Format 2: a directory checkpoint as files stored once by content; what both sides share.

A format-2 manifest lists the tree's entries; a file's content is a sequence of *blobs*,
each a byte range of a content *object* under ``objects/``. A blob is compressed on its own
where it pays (:func:`choose_codec`, :func:`encode`, :func:`decode`) and known by the
XXH3-128 of its content; an object is named by the XXH3-128 of its stored bytes
(:func:`content_hash`, both). :mod:`taskpoint.format._tree_save` stores a tree that way
(:func:`~taskpoint.format._tree_save.save_tree`); :mod:`taskpoint.format._tree_restore` restores one
(:func:`~taskpoint.format._tree_restore.restore_tree`) and verifies one
(:func:`~taskpoint.format._tree_restore.verify_tree`).

An object that a restore or a verification finds missing or damaged is remembered for the
store (in this process: :func:`mark_broken`) and no save references it again
(:func:`broken_in`): the next save that holds its content uploads it anew (for an unchanged
file, packed the same way, so under the same name, which repairs it for the older
checkpoints too; :func:`mark_written`).

Example::

    known = _tree_save.BlobIndex.of(manifests)
    saved = _tree_save.save_tree(store, Path("out"), known)
    _tree_restore.restore_tree(store, manifest, Path("restored"))
"""

from __future__ import annotations

import threading

import xxhash

from taskpoint.format import archive
from taskpoint.format.manifest import Codec
from taskpoint.store.store import Store

__all__ = [
    "MIN_WORKERS",
    "broken_in",
    "choose_codec",
    "content_hash",
    "decode",
    "encode",
    "mark_broken",
    "mark_written",
]

MIN_WORKERS = 8
"""The fewest threads a tree's save or verification transfers with."""


_broken: dict[str, set[str]] = {}
"""By store URL, the objects found missing or damaged there and not uploaded since."""
_broken_lock = threading.Lock()


def mark_broken(store: Store, name: str) -> None:
    """Remember that ``store``'s object ``name`` was found missing or damaged."""
    with _broken_lock:
        _broken.setdefault(store.url, set()).add(name)


def mark_written(store: Store, name: str) -> None:
    """Forget ``name`` as broken: it was just written to ``store`` anew."""
    with _broken_lock:
        _broken.get(store.url, set()).discard(name)


def broken_in(store: Store) -> frozenset[str]:
    """The objects of ``store`` found missing or damaged and not written since."""
    with _broken_lock:
        return frozenset(_broken.get(store.url, ()))


def content_hash(data: bytes | memoryview) -> str:
    """The XXH3-128 of ``data``, in hex: a blob's hash, or an object's name."""
    return xxhash.xxh3_128_hexdigest(data)


def choose_codec(data: bytes | memoryview, wanted: Codec) -> Codec:
    """``wanted``, unless ``data`` is too small or a sample says compressing it won't pay."""
    if wanted == "none" or len(data) < 64 or not archive.worth_compressing(data):
        return "none"
    return wanted


def encode(data: bytes | memoryview, codec: Codec) -> bytes:
    """A blob's stored bytes: ``data`` compressed with ``codec``."""
    if codec == "gzip":
        return archive.gzip_bytes(data)
    if codec == "zstd":
        return bytes(archive.import_zstandard().ZstdCompressor(level=3).compress(data))
    return bytes(data)


def decode(data: bytes | memoryview, codec: str) -> bytes:
    """A blob's content: its stored bytes ``data`` decompressed with ``codec``."""
    if codec == "gzip":
        from isal import igzip

        return bytes(igzip.decompress(data))  # type: ignore[no-untyped-call]
    if codec == "zstd":
        return bytes(archive.import_zstandard().ZstdDecompressor().decompress(data))
    return bytes(data)

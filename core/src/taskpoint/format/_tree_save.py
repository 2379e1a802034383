"""Saving a format-2 tree (see :mod:`taskpoint.format.tree`): files stored once by content.

Saving walks the tree and stores each file's content as *blobs*: a small file (below
:data:`SMALL_FILE`) is one blob, packed with the save's other new small files into pack
objects of about :data:`PACK_SIZE`; a larger file is cut by content-defined chunking
(FastCDC 2020, from ``pyfastcdc``) into blobs of :data:`CHUNK_AVG` bytes on average, so
that a near-copy of a file (Lightning's ``last.ckpt`` beside the epoch checkpoint) shares
all but the chunks around its differences. A blob the run's store already holds, by the
manifests committed there (read once, then kept in memory), is referenced, not uploaded.
The new chunks of one file are packed, in order, into objects of about :data:`PACK_SIZE`
too: deduplication stays per chunk (a blob is a range of an object), while a save and a
restore make one request per 8 MiB rather than per 512 KiB chunk. Each blob is
compressed where a 64 KiB sample says it pays (text yes, fp32 weights no); each object is
named by the XXH3-128 of its stored bytes and uploaded by a thread pool while hashing and
chunking go on; nothing is spooled to local disk.

Example::

    known = BlobIndex.of(manifests)
    saved = save_tree(store, Path("out"), known)
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from taskpoint.errors import CheckpointSaveError, _SaveStopped
from taskpoint.format import archive
from taskpoint.format._digest import Progress
from taskpoint.format._statcache import (
    ContentKey,
    Record,
    StatCache,
    StatKey,
    content_key,
    now_ns,
    settled,
    stat_key,
)
from taskpoint.format.manifest import Blob, Codec, Entry, Manifest
from taskpoint.format.retention import OBJECTS
from taskpoint.format.tree import (
    MIN_WORKERS,
    broken_in,
    choose_codec,
    content_hash,
    encode,
    mark_written,
)
from taskpoint.store.store import Store

__all__ = [
    "CHUNK_AVG",
    "PACK_SIZE",
    "SMALL_FILE",
    "BlobIndex",
    "SavedTree",
    "check_pinned",
    "content_now",
    "save_tree",
]

SMALL_FILE = 256 * 1024
"""Files smaller than this are packed with others instead of being chunked."""
PACK_SIZE = 8 * 2**20
"""About how many raw bytes one pack object gathers (small files, or one file's chunks).

Measured by ``bench/bench_incremental.py`` on SeaweedFS (2-core VM): restoring 512 MB
stored as one object per 512 KiB chunk took 8.7 s against 1.9 s for a raw parallel get of
the same files, and 1.05 s (raw get 1.3 s) with the chunks packed into 8 MiB objects: the
server's and the client's cost is per request. 8 MiB is also the default part size."""
CHUNK_AVG = 512 * 1024
"""FastCDC's average chunk size (minimum a quarter, maximum four times).

Measured by ``bench/bench_incremental.py`` (README, "Incremental saves"): per save, over one
``.ckpt``, Lightning's ``save_last=True`` uploads 1.003 at 128 KiB, 1.011 at 512 KiB and
1.088 at 2 MiB (the chunk that straddles each difference between ``last.ckpt`` and the
epoch file is resent, and a larger chunk resends more); an HF ``output_dir`` uploads 0.99-1.0
of one ``checkpoint-N`` at every size. 128 KiB saves 0.8% of the bytes for four times the
chunks (manifest entries, hashing and lookups; requests no longer, chunks being packed),
so 512 KiB stays."""


class BlobIndex:
    """The blobs a run's store holds, by content hash, from its committed manifests."""

    def __init__(self) -> None:
        self._blobs: dict[str, Blob] = {}
        self.objects: dict[str, int] = {}  # stored size of each object the blobs lie in

    @classmethod
    def of(cls, manifests: Iterable[Manifest], bad: Iterable[str] = ()) -> BlobIndex:
        """The blobs of ``manifests``' trees, less those in objects named in ``bad``."""
        index = cls()
        excluded = set(bad)
        for manifest in manifests:
            index.objects.update(manifest.objects or {})
            for entry in manifest.entries or ():
                for blob in entry.blobs:
                    if blob.object not in excluded:
                        index._blobs.setdefault(blob.hash, blob)
        return index

    def get(self, digest: str) -> Blob | None:
        return self._blobs.get(digest)

    def __len__(self) -> int:
        return len(self._blobs)


@dataclass
class SavedTree:
    """What :func:`save_tree` stored: the entries, the objects they use, and its cost."""

    entries: tuple[Entry, ...]
    objects: dict[str, int]
    size: int
    uploaded: int
    reused: int
    seen: dict[str, Record] = field(default_factory=dict)
    """The files to trust unchanged while their stat stays (see :mod:`taskpoint.format._statcache`),
    once the save has committed."""


@dataclass
class _Pending:
    """A blob whose object is still being made (a pack not yet sealed, a chunk uploading)."""

    hash: str
    size: int
    codec: Codec = "none"
    object: str | None = None
    offset: int = 0
    length: int = 0

    def blob(self) -> Blob:
        assert self.object is not None
        return Blob(self.object, self.offset, self.length, self.codec, self.size, self.hash)


@dataclass
class _FileRefs:
    path: str
    mode: int
    mtime_ns: int
    size: int
    hash: str
    parts: list[Blob | _Pending] = field(default_factory=list)


class _Uploader:
    """Uploads objects from a thread pool, at most ``limit`` jobs in flight.

    Each job is one pack of about :data:`PACK_SIZE` raw bytes, so ``limit * PACK_SIZE``
    bounds the memory a save holds (64 MiB with the defaults, as much as one multipart
    transfer of :class:`taskpoint.store.transfer.Transfer`'s defaults, plus the buffer being
    filled and, for an object store, each pack's joined copy)."""

    def __init__(self, store: Store, workers: int, stop: threading.Event | None = None) -> None:
        self._store = store
        self._stop = stop
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="taskpoint-put")
        self.limit = workers
        self._futures: set[Future[None]] = set()
        self.objects: dict[str, int] = {}
        self.uploaded = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in the pool (it calls :meth:`put`), once fewer than ``limit`` run.

        Raises:
            _SaveStopped: the save was told to stop (its packs in flight finish first).
        """
        while len(self._futures) >= self.limit:
            done, self._futures = wait(self._futures, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()
        if self._stop is not None and self._stop.is_set():
            raise _SaveStopped(f"a save to {self._store.url} was stopped: a newer one replaced it")
        self._futures.add(self._pool.submit(job))

    def put(self, name: str, parts: list[bytes | memoryview]) -> None:
        """Store the object ``name`` holding ``parts`` in order."""
        self._store.write_parts(f"{OBJECTS}/{name}", parts)
        mark_written(self._store, name)
        size = sum(len(p) for p in parts)
        with self._lock:
            self.objects[name] = size
            self.uploaded += size

    def finish(self) -> None:
        try:
            for future in self._futures:
                future.result()
        finally:
            self.close()

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)


class _Buffers:
    """Pack buffers, reused within a save.

    Copying each new chunk into a fresh ``bytes`` and joining a pack's chunks into another
    touched about twice the saved bytes of new memory, and new memory costs a page fault
    per 4 KiB: a fresh 200 MB save to ``file://`` on the (shared) 2-core VM of the
    benchmarks took a median 0.37 s that way (0.22-0.80 s), against 0.26 s (0.21-0.29 s)
    with chunks copied once into reused buffers and written from there (a raw put: 0.06 s).
    A save holds at most one buffer per upload worker plus one being filled (about 90 MiB
    with the defaults) and, on an object store, a joined copy of each pack being uploaded
    (about 64 MiB more); none of it grows with the checkpoint.
    """

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if len(buffer) >= size:
                    return self._free.pop(i)
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            self._free.append(buffer)


class _Packer:
    """Gathers new blobs into pack objects of about :data:`PACK_SIZE` raw bytes.

    Blobs are copied into a reused buffer; each is encoded on its own (so it can be read
    back alone, by a ranged read) in the upload pool, which then names the pack by the
    hash of its stored bytes and writes it from the buffer.
    """

    def __init__(self, uploader: _Uploader, codec: Codec, buffers: _Buffers) -> None:
        self._uploader = uploader
        self._codec = codec
        self._buffers = buffers
        self._capacity = PACK_SIZE + 4 * CHUNK_AVG  # room for one more chunk at most
        self._buffer: bytearray | None = None
        self._members: list[tuple[_Pending, int, int]] = []  # blob, where in the buffer
        self._used = 0

    def add(self, digest: str, data: bytes | memoryview) -> _Pending:
        size = len(data)
        if self._buffer is not None and self._used + size > len(self._buffer):
            self.seal()
        if self._buffer is None:
            self._buffer = self._buffers.take(max(self._capacity, size))
        self._buffer[self._used : self._used + size] = data
        pending = _Pending(digest, size)
        self._members.append((pending, self._used, size))
        self._used += size
        if self._used >= PACK_SIZE:
            self.seal()
        return pending

    def seal(self) -> None:
        buffer, members = self._buffer, self._members
        self._buffer, self._members, self._used = None, [], 0
        if buffer is None:
            return
        if not members:
            self._buffers.give(buffer)
            return
        codec, uploader, buffers = self._codec, self._uploader, self._buffers

        def run() -> None:
            try:
                view = memoryview(buffer)
                parts: list[bytes | memoryview] = []
                digest = xxhash.xxh3_128()
                offset = 0
                for pending, at, size in members:
                    raw = view[at : at + size]
                    pending.codec = choose_codec(raw, codec)
                    stored = raw if pending.codec == "none" else encode(raw, pending.codec)
                    pending.offset, pending.length = offset, len(stored)
                    offset += len(stored)
                    digest.update(stored)
                    parts.append(stored)
                name = digest.hexdigest()
                for pending, _, _ in members:
                    pending.object = name
                if all(pending.codec == "none" for pending, _, _ in members):
                    # Stored as they lie, one after another from the buffer's start: the
                    # object is that stretch of the buffer, sent without joining a copy.
                    parts = [view[:offset]]
                uploader.put(name, parts)
            finally:
                buffers.give(buffer)

        uploader.submit(run)


def _chunker() -> Any:
    from pyfastcdc import FastCDC

    return FastCDC(CHUNK_AVG, min_size=CHUNK_AVG // 4, max_size=CHUNK_AVG * 4)


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result, Path]]:
    for path in archive.walk_tree(root):
        yield path.relative_to(root).as_posix(), path.lstat(), path


def save_tree(
    store: Store,
    root: Path,
    known: BlobIndex,
    *,
    codec: Codec = "gzip",
    workers: int = MIN_WORKERS,
    progress: Progress | None = None,
    seen: StatCache | None = None,
    pinned: Mapping[str, ContentKey] | None = None,
    stop: threading.Event | None = None,
) -> SavedTree:
    """Store the tree under ``root`` as content objects; the entries a manifest lists.

    Content in ``known`` is referenced, not uploaded, unless its object was found missing
    or damaged since (by a restore or verification in this process). A file that ``seen``
    knows unchanged since a committed save or a restore is not read again, if every object
    its blobs lie in is in ``known`` and not found damaged. The caller has checked the
    tree (:func:`taskpoint.format.archive.check_tree`) before calling.

    ``pinned`` maps paths within ``root`` to the :func:`~taskpoint.format._statcache.content_key`
    their files had when a hard-linked snapshot took them: such a file is read only while
    it still has that key, so a file rewritten in place through another of its names is
    never stored, whole or torn.

    Once ``stop`` is set, no further pack object starts uploading and the save raises.

    Raises:
        CheckpointStoreError: an upload failed (objects already sent stay, unreferenced,
            until a collection).
        CheckpointSaveError: a ``pinned`` file changed after its snapshot was taken.
        _SaveStopped: ``stop`` was set (objects already sent stay, as above).
    """
    uploader = _Uploader(store, max(workers, MIN_WORKERS), stop)
    buffers = _Buffers()
    packer = _Packer(uploader, codec, buffers)  # small files
    chunks = _Packer(uploader, codec, buffers)  # the new chunks of one larger file at a time
    chunker = _chunker()
    fresh: dict[str, Blob | _Pending] = {}  # new this save, by hash
    refs: list[_FileRefs | Entry] = []
    inodes: dict[tuple[int, int], str] = {}
    broken = broken_in(store)
    reused = 0
    total = 0
    clock = now_ns()
    trusted: dict[str, StatKey] = {}  # files read (or known) whose stat can be trusted
    try:
        for rel, st, path in _walk(root):
            if stat.S_ISDIR(st.st_mode):
                refs.append(Entry(rel, "dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns))
                continue
            if stat.S_ISLNK(st.st_mode):
                refs.append(Entry(rel, "symlink", target=os.readlink(path)))
                continue
            if st.st_nlink > 1:
                first = inodes.setdefault((st.st_dev, st.st_ino), rel)
                if first != rel:
                    refs.append(Entry(rel, "hardlink", target=first))
                    continue
            known_entry = seen.lookup(root, rel, st) if seen is not None else None
            if known_entry is not None and all(
                b.object in known.objects and b.object not in broken for b in known_entry.blobs
            ):
                refs.append(dataclasses.replace(
                    known_entry, path=rel, mode=stat.S_IMODE(st.st_mode), mtime_ns=st.st_mtime_ns
                ))
                trusted[rel] = stat_key(st)
                reused += known_entry.size
                total += known_entry.size
                if progress is not None:
                    progress(known_entry.size)
                continue
            pin = pinned.get(rel) if pinned is not None else None
            if pin is not None:
                check_pinned(root, rel, content_key(st), pin, url=store.url)
            whole = xxhash.xxh3_128()
            small = st.st_size < SMALL_FILE
            file = _FileRefs(rel, stat.S_IMODE(st.st_mode), st.st_mtime_ns, 0, "")
            for piece in _pieces(path, st.st_size, chunker):
                whole.update(piece)
                digest = content_hash(piece)
                file.size += len(piece)
                if progress is not None:
                    progress(len(piece))
                found: Blob | _Pending | None = known.get(digest)
                if found is not None and found.object in broken:
                    found = None
                found = found or fresh.get(digest)
                if found is not None:
                    reused += len(piece)
                    file.parts.append(found)
                    continue
                pending = (packer if small else chunks).add(digest, piece)
                fresh[digest] = pending
                file.parts.append(pending)
            chunks.seal()
            if pin is not None:
                check_pinned(root, rel, content_now(path), pin, url=store.url)
            file.hash = f"xxh3-128:{whole.hexdigest()}"
            total += file.size
            refs.append(file)
            if seen is not None and settled(st, clock) and _unchanged(path, st):
                trusted[rel] = stat_key(st)
        packer.seal()
        uploader.finish()
    except BaseException:
        uploader.close()
        raise
    entries = tuple(_entry(ref) for ref in refs)
    objects: dict[str, int] = {}
    for entry in entries:
        for blob in entry.blobs:
            # An empty file's object has size 0: look it up by membership, never by truth.
            size = uploader.objects.get(blob.object)
            objects[blob.object] = known.objects[blob.object] if size is None else size
    records = {
        e.path: Record(trusted[e.path], e) for e in entries if e.path in trusted
    }
    return SavedTree(entries, objects, total, uploader.uploaded, reused, records)


def content_now(path: Path) -> ContentKey | None:
    """``path``'s :func:`~taskpoint.format._statcache.content_key`, ``None`` if it is gone."""
    try:
        return content_key(path.lstat())
    except OSError:
        return None


def check_pinned(
    root: Path, rel: str, now: ContentKey | None, pin: ContentKey, *, url: str
) -> None:
    """Raise unless a snapshot's hard-linked file still has the content it was taken with.

    Raises:
        CheckpointSaveError: it was rewritten in place (the save for ``url`` must not commit).
    """
    if now != pin:
        raise CheckpointSaveError(
            f"cannot commit the snapshot {str(root)!r}: its file {rel!r} was rewritten in "
            "place after the snapshot hard-linked it (its content is no longer the "
            "snapshot's, and may be half written); nothing was committed. Replace or "
            "delete checkpoint files instead of rewriting them in place, or save with "
            'snapshot="copy"',
            url=url,
        )


def _unchanged(path: Path, before: os.stat_result) -> bool:
    """Whether ``path`` still has the stat ``before`` (taken before it was read)."""
    try:
        return stat_key(path.lstat()) == stat_key(before)
    except OSError:
        return False


def _pieces(path: Path, size: int, chunker: Any) -> Iterator[memoryview | bytes]:
    """A file's content: whole when small, else its content-defined chunks."""
    if size < SMALL_FILE:
        data = path.read_bytes()
        if len(data) < SMALL_FILE:
            yield data
            return
    for chunk in chunker.cut_file(str(path)):
        yield chunk.data


def _entry(ref: _FileRefs | Entry) -> Entry:
    if isinstance(ref, Entry):
        return ref
    blobs = tuple(p.blob() if isinstance(p, _Pending) else p for p in ref.parts)
    return Entry(ref.path, "file", ref.mode, ref.mtime_ns, ref.size, ref.hash, blobs)


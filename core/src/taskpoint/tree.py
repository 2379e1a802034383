"""Format 2: a directory checkpoint as files stored once by content.

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

Restoring checks every path with :class:`taskpoint.archive.Extractor` (the rules that guard
tar restores), reads in parallel each object whole, or the stretches of it that the tree
uses by ranged reads, verifies each blob against its hash, and writes blobs straight to
their offsets. Restoring into a directory that already holds some files keeps every file
whose size and hash match.

An object that a restore or a verification finds missing or damaged is remembered for the
store (in this process) and no save references it again: the next save that holds its
content uploads it anew (for an unchanged file, packed the same way, so under the same
name, which repairs it for the older checkpoints too).

Example::

    known = BlobIndex.of(manifests)
    saved = save_tree(store, Path("out"), known)
    restore_tree(store, manifest, Path("restored"))
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import shutil
import stat
import tarfile
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from taskpoint import archive
from taskpoint._digest import Progress
from taskpoint._statcache import Record, StatCache, StatKey, now_ns, settled, stat_key
from taskpoint.errors import CheckpointCorruptError, CheckpointStoreError
from taskpoint.manifest import Blob, Codec, Entry, Manifest
from taskpoint.retention import OBJECTS
from taskpoint.store import Store

__all__ = [
    "CHUNK_AVG",
    "PACK_SIZE",
    "SMALL_FILE",
    "BlobIndex",
    "SavedTree",
    "restore_tree",
    "save_tree",
    "swap_into",
    "verify_tree",
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
_MIN_WORKERS = 8


_broken: dict[str, set[str]] = {}
"""By store URL, the objects found missing or damaged there and not uploaded since."""
_broken_lock = threading.Lock()


def _mark_broken(store: Store, name: str) -> None:
    with _broken_lock:
        _broken.setdefault(store.url, set()).add(name)


def _mark_written(store: Store, name: str) -> None:
    with _broken_lock:
        _broken.get(store.url, set()).discard(name)


def _broken_in(store: Store) -> frozenset[str]:
    with _broken_lock:
        return frozenset(_broken.get(store.url, ()))


def _hash(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


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
    """The files to trust unchanged while their stat stays (see :mod:`taskpoint._statcache`),
    once the save has committed."""


def _codec_for(data: bytes | memoryview, wanted: Codec) -> Codec:
    if wanted == "none" or len(data) < 64 or not archive.worth_compressing(data):
        return "none"
    return wanted


def _encode(data: bytes | memoryview, codec: Codec) -> bytes:
    if codec == "gzip":
        return archive.gzip_bytes(data)
    if codec == "zstd":
        return bytes(archive.import_zstandard().ZstdCompressor(level=3).compress(data))
    return bytes(data)


def _decode(data: bytes | memoryview, codec: str) -> bytes:
    if codec == "gzip":
        from isal import igzip

        return bytes(igzip.decompress(data))  # type: ignore[no-untyped-call]
    if codec == "zstd":
        return bytes(archive.import_zstandard().ZstdDecompressor().decompress(data))
    return bytes(data)


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
    transfer of :class:`taskpoint.transfer.Transfer`'s defaults, plus the buffer being
    filled and, for an object store, each pack's joined copy)."""

    def __init__(self, store: Store, workers: int) -> None:
        self._store = store
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="taskpoint-put")
        self.limit = workers
        self._futures: set[Future[None]] = set()
        self.objects: dict[str, int] = {}
        self.uploaded = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in the pool (it calls :meth:`put`), once fewer than ``limit`` run."""
        while len(self._futures) >= self.limit:
            done, self._futures = wait(self._futures, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()
        self._futures.add(self._pool.submit(job))

    def put(self, name: str, parts: list[bytes | memoryview]) -> None:
        """Store the object ``name`` holding ``parts`` in order."""
        self._store.write_parts(f"{OBJECTS}/{name}", parts)
        _mark_written(self._store, name)
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
    with the defaults).
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
                    pending.codec = _codec_for(raw, codec)
                    stored = raw if pending.codec == "none" else _encode(raw, pending.codec)
                    pending.offset, pending.length = offset, len(stored)
                    offset += len(stored)
                    digest.update(stored)
                    parts.append(stored)
                name = digest.hexdigest()
                for pending, _, _ in members:
                    pending.object = name
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
    workers: int = _MIN_WORKERS,
    progress: Progress | None = None,
    seen: StatCache | None = None,
) -> SavedTree:
    """Store the tree under ``root`` as content objects; the entries a manifest lists.

    Content in ``known`` is referenced, not uploaded, unless its object was found missing
    or damaged since (by a restore or verification in this process). A file that ``seen``
    knows unchanged since a committed save or a restore is not read again, if every object
    its blobs lie in is in ``known`` and not found damaged. The caller has checked the
    tree (:func:`taskpoint.archive.check_tree`) before calling.

    Raises:
        CheckpointStoreError: an upload failed (objects already sent stay, unreferenced,
            until a collection).
    """
    uploader = _Uploader(store, max(workers, _MIN_WORKERS))
    buffers = _Buffers()
    packer = _Packer(uploader, codec, buffers)  # small files
    chunks = _Packer(uploader, codec, buffers)  # the new chunks of one larger file at a time
    chunker = _chunker()
    fresh: dict[str, Blob | _Pending] = {}  # new this save, by hash
    refs: list[_FileRefs | Entry] = []
    inodes: dict[tuple[int, int], str] = {}
    broken = _broken_in(store)
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
            whole = xxhash.xxh3_128()
            small = st.st_size < SMALL_FILE
            file = _FileRefs(rel, stat.S_IMODE(st.st_mode), st.st_mtime_ns, 0, "")
            for piece in _pieces(path, st.st_size, chunker):
                whole.update(piece)
                digest = _hash(piece)
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
            objects[blob.object] = uploader.objects.get(blob.object) or known.objects[blob.object]
    records = {
        e.path: Record(trusted[e.path], e) for e in entries if e.path in trusted
    }
    return SavedTree(entries, objects, total, uploader.uploaded, reused, records)


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


# -- restoring ------------------------------------------------------------------------


class _Member(tarfile.TarInfo):
    """A manifest entry as the extractor's record, keeping the nanosecond mtime."""

    __slots__ = ("mtime_ns",)
    mtime_ns: int


def _members(entries: Iterable[Entry]) -> Iterator[tarfile.TarInfo]:
    for entry in entries:
        info = _Member(entry.path)
        info.mode = entry.mode
        info.mtime = entry.mtime_ns / 1e9
        info.mtime_ns = entry.mtime_ns
        info.type = {
            "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE,
            "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
        }[entry.type]
        info.size = entry.size
        if entry.target is not None:
            info.linkname = entry.target
        yield info


@dataclass(frozen=True)
class _Place:
    path: Path
    offset: int  # in the file
    blob: Blob


def _fetch(store: Store, manifest: Manifest, name: str, url: str) -> bytes:
    key = f"{OBJECTS}/{name}"
    try:
        data = store.read_bytes(key)
    except FileNotFoundError:
        _mark_broken(store, name)
        raise CheckpointCorruptError(
            f"checkpoint {url} needs object {store.url_of(key)}, which is missing", url=url
        ) from None
    expected = (manifest.objects or {}).get(name)
    if len(data) != expected or _hash(data) != name:
        _mark_broken(store, name)
        raise CheckpointCorruptError(
            f"object {store.url_of(key)} of checkpoint {url} is damaged: {len(data)} bytes "
            f"hashing to {_hash(data)}, expected {expected} bytes hashing to {name}",
            url=url,
        )
    return data


def _blob_bytes(store: Store, data: bytes | memoryview, blob: Blob, url: str) -> bytes | memoryview:
    """The decoded bytes of ``blob``, which ``data`` holds whole, checked against its hash."""
    try:
        raw = _decode(data, blob.codec) if blob.codec != "none" else data
    except Exception as exc:
        _mark_broken(store, blob.object)
        raise CheckpointCorruptError(
            f"a blob of object {store.url_of(f'{OBJECTS}/{blob.object}')} of checkpoint "
            f"{url} cannot be decoded ({type(exc).__name__}: {exc}): the object is damaged",
            url=url,
        ) from exc
    if len(raw) != blob.size or _hash(raw) != blob.hash:
        _mark_broken(store, blob.object)
        raise CheckpointCorruptError(
            f"a blob of object {store.url_of(f'{OBJECTS}/{blob.object}')} of checkpoint "
            f"{url} does not match its hash {blob.hash}: the object is damaged",
            url=url,
        )
    return raw


_GAP = 2**20
"""Blobs of one object this close together are fetched by one read, gap included."""


def _spans(places: list[_Place]) -> list[tuple[int, int, list[_Place]]]:
    """The byte ranges of an object to read for ``places``, each with the places in it."""
    spans: list[tuple[int, int, list[_Place]]] = []
    for place in sorted(places, key=lambda p: p.blob.offset):
        start, end = place.blob.offset, place.blob.offset + place.blob.length
        if spans and start - spans[-1][1] <= _GAP:
            first, last, members = spans[-1]
            spans[-1] = (first, max(last, end), [*members, place])
        else:
            spans.append((start, end, [place]))
    return spans


def _read_span(
    store: Store, manifest: Manifest, name: str, start: int, end: int, url: str
) -> bytes:
    """Bytes ``start:end`` of object ``name``: the whole object when that is what they are."""
    key = f"{OBJECTS}/{name}"
    size = (manifest.objects or {}).get(name)
    try:
        if start == 0 and end == size:
            data = store.read_bytes(key)
        else:
            data = store.read_range(key, start, end)
    except FileNotFoundError:
        _mark_broken(store, name)
        raise CheckpointCorruptError(
            f"checkpoint {url} needs object {store.url_of(key)}, which is missing", url=url
        ) from None
    if len(data) != end - start:
        _mark_broken(store, name)
        raise CheckpointCorruptError(
            f"object {store.url_of(key)} of checkpoint {url} is damaged: bytes {start}-{end} "
            f"of its {size} read back as {len(data)}",
            url=url,
        )
    return data


def _place(
    store: Store,
    data: memoryview,
    start: int,
    members: list[_Place],
    url: str,
    progress: Progress | None,
) -> None:
    """Check the blobs of ``members`` in ``data`` (an object's bytes from ``start`` on) and
    write each where it goes."""
    checked: dict[Blob, bytes | memoryview] = {}
    for place in members:
        blob = place.blob
        raw = checked.get(blob)
        if raw is None:
            at = blob.offset - start
            raw = checked[blob] = _blob_bytes(store, data[at : at + blob.length], blob, url)
        fd = os.open(place.path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.pwrite(fd, raw, place.offset)
        finally:
            os.close(fd)
        if progress is not None:
            progress(len(raw))


@contextlib.contextmanager
def _mapped(
    store: Store, manifest: Manifest, name: str, local: str, url: str
) -> Iterator[memoryview]:
    """The object ``name`` of a store on the local disk, mapped rather than read.

    Measured on a 2-core VM (bench_incremental, 512 MB): reading each 8 MiB object into a
    fresh buffer and writing from it took 0.35 s against 0.18 s for a plain copy of the
    files; hashing straight from the page cache through the map, then writing, saves the
    buffer and its copy. Objects are replaced, never written in place, so the bytes
    written are the ones hashed.
    """
    key = f"{OBJECTS}/{name}"
    expected = (manifest.objects or {}).get(name)
    try:
        fd = os.open(local, os.O_RDONLY)
    except FileNotFoundError:
        _mark_broken(store, name)
        raise CheckpointCorruptError(
            f"checkpoint {url} needs object {store.url_of(key)}, which is missing", url=url
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            _mark_broken(store, name)
            raise CheckpointCorruptError(
                f"object {store.url_of(key)} of checkpoint {url} is damaged: {size} bytes, "
                f"expected {expected}",
                url=url,
            )
        if size == 0:
            yield memoryview(b"")
            return
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        try:
            yield memoryview(mapped)
        finally:
            with contextlib.suppress(BufferError):  # views kept by a traceback: GC unmaps
                mapped.close()
    finally:
        os.close(fd)


def _download(
    store: Store,
    manifest: Manifest,
    places: dict[str, list[_Place]],
    url: str,
    workers: int,
    progress: Progress | None,
) -> None:
    """Fetch what each object of ``places`` holds for them and write its blobs where they go.

    An object is read whole when its blobs cover it (a pack written by one save), else by
    ranged reads of the stretches they lie in. Every blob is checked against its hash,
    which covers every byte written (an object's own hash would only add a second pass).
    """
    jobs = [
        (name, start, end, members)
        for name, of_object in places.items()
        for start, end, members in _spans(of_object)
    ]

    def one(index: str) -> None:
        name, start, end, members = jobs[int(index)]
        local = store.local_path(f"{OBJECTS}/{name}")
        if local is not None:
            with _mapped(store, manifest, name, local, url) as data:
                _place(store, data, 0, members, url, progress)
        else:
            data = memoryview(_read_span(store, manifest, name, start, end, url))
            _place(store, data, start, members, url, progress)

    _run_all(workers, one, [str(i) for i in range(len(jobs))])


def _run_all(workers: int, fn: Callable[[str], None], items: Iterable[str]) -> None:
    """``fn`` over ``items`` in a pool; the first failure is raised, the rest cancelled."""
    with ThreadPoolExecutor(workers, thread_name_prefix="taskpoint-get") as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def verify_tree(store: Store, manifest: Manifest, *, workers: int = _MIN_WORKERS) -> bool:
    """Whether every object and blob of ``manifest`` is in the store and intact.

    Raises:
        CheckpointStoreError: the store failed.
    """
    url = store.url_of(f"checkpoints/{manifest.key}")
    by_object: dict[str, list[Blob]] = defaultdict(list)
    for entry in manifest.entries or ():
        for blob in entry.blobs:
            by_object[blob.object].append(blob)

    def one(name: str) -> None:
        data = memoryview(_fetch(store, manifest, name, url))
        for blob in by_object[name]:
            _blob_bytes(store, data[blob.offset : blob.offset + blob.length], blob, url)

    try:
        _run_all(max(workers, _MIN_WORKERS), one, by_object)
    except CheckpointStoreError:
        raise
    except CheckpointCorruptError:
        return False
    return True


def _present(base: Path, rel: str) -> Path | None:
    """``base/rel`` if it is a regular file reached through real directories only.

    ``rel`` is a manifest's, not yet checked by the extractor: one no path can name (a NUL
    in it) is not present, and the extractor refuses it next.
    """
    here = base
    parts = rel.split("/")
    for part in parts[:-1]:
        here = here / part
        try:
            if not stat.S_ISDIR(here.lstat().st_mode):
                return None
        except (OSError, ValueError):
            return None
    here = here / parts[-1]
    try:
        return here if stat.S_ISREG(here.lstat().st_mode) else None
    except (OSError, ValueError):
        return None


def _matches(path: Path, entry: Entry) -> bool:
    try:
        if path.lstat().st_size != entry.size:
            return False
        digest = xxhash.xxh3_128()
        with open(path, "rb", buffering=0) as fh:
            while block := fh.read(8 * 2**20):
                digest.update(block)
        return f"xxh3-128:{digest.hexdigest()}" == entry.hash
    except OSError:
        return False


def _reusable(
    existing: Path | None, entries: tuple[Entry, ...], workers: int, seen: StatCache | None
) -> dict[str, Path]:
    """Files already at ``existing`` that match their entry, by path.

    A file ``seen`` knows unchanged since taskpoint wrote or read it with the entry's
    content is taken without being read (see :mod:`taskpoint._statcache`); any other is
    hashed.
    """
    if existing is None:
        return {}
    candidates = {
        e.path: p for e in entries
        if e.type == "file" and (p := _present(existing, e.path)) is not None
    }
    by_path = {e.path: e for e in entries}
    found: dict[str, Path] = {}
    if seen is not None:
        for rel, path in list(candidates.items()):
            try:
                st = path.lstat()
            except OSError:
                continue
            known = seen.lookup(existing, rel, st)
            if known is not None and (known.size, known.hash) == (
                by_path[rel].size, by_path[rel].hash
            ):
                found[rel] = candidates.pop(rel)

    def check(rel: str) -> None:
        if _matches(candidates[rel], by_path[rel]):
            found[rel] = candidates[rel]

    _run_all(workers, check, candidates)
    return found


def restore_tree(
    store: Store,
    manifest: Manifest,
    dest: Path,
    *,
    existing: Path | None = None,
    workers: int = 16,
    progress: Progress | None = None,
    seen: StatCache | None = None,
) -> int:
    """Restore ``manifest``'s tree into the new directory ``dest``; the bytes downloaded.

    Files of ``existing`` (a directory) that match an entry's size and hash are linked
    (or copied) instead of downloaded; ``seen`` vouches for the files it knows unchanged.

    Raises:
        CheckpointUnsafeError: an entry is absolute, climbs out with ``..``, is listed
            twice, lies under a link, or links outside the tree. Nothing is written for it.
        CheckpointCorruptError: an object is missing or damaged.
        CheckpointStoreError: the store failed.
        OSError: writing under ``dest`` failed.
    """
    url = store.url_of(f"checkpoints/{manifest.key}")
    entries = manifest.entries or ()
    keep = _reusable(existing, entries, workers, seen)
    by_path = {e.path: e for e in entries if e.type == "file"}
    places: dict[str, list[_Place]] = defaultdict(list)
    kept: list[tuple[Path, Path]] = []

    def write(member: tarfile.TarInfo, path: Path, out: BinaryIO) -> None:
        if member.name in keep:
            kept.append((keep[member.name], path))
            return
        entry = by_path[member.name]
        out.truncate(entry.size)
        offset = 0
        for blob in entry.blobs:
            places[blob.object].append(_Place(path, offset, blob))
            offset += blob.size

    def fill() -> None:
        for source, path in kept:
            _adopt(source, path)
        _download(store, manifest, places, url, workers, progress)

    dest.mkdir(parents=True, exist_ok=True)
    archive.Extractor(_members(entries), dest, write).run(fill)
    return sum(b.size for ps in places.values() for b in (p.blob for p in ps))


def _adopt(source: Path, path: Path) -> None:
    """Put the existing file ``source`` at ``path`` (just created, empty): a hard link
    where the disk allows, else a copy. When the tree's hard links already point at
    ``path``, its content is copied in, so that they see it too."""
    if path.lstat().st_nlink > 1:
        shutil.copyfile(source, path, follow_symlinks=False)
        return
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        os.link(source, tmp, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK):
            raise
        shutil.copyfile(source, tmp, follow_symlinks=False)
    os.replace(tmp, path)


def swap_into(restored: Path, into: Path) -> None:
    """Make the directory ``into`` hold exactly what ``restored`` holds.

    ``restored`` lies in a staging folder inside ``into``, which is kept for the caller to
    remove. What else ``into`` holds is removed (links are removed, never followed), then
    ``restored``'s entries are moved in.
    """
    staging = into / restored.relative_to(into).parts[0]
    for path in list(into.iterdir()):
        if path != staging:
            _remove(path)
    for path in sorted(restored.iterdir()):
        os.replace(path, into / path.name)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(path.lstat().st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()


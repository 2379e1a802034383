"""Restoring and verifying a format-2 tree (see :mod:`taskpoint.format.tree`).

Restoring checks every path with :class:`taskpoint.format.archive.Extractor` (the rules that guard
tar restores), reads in parallel each object whole, or the stretches of it that the tree
uses by ranged reads, verifies each blob against its hash, and writes blobs straight to
their offsets. A file of one blob (every small file) is created holding it, with its mode
and time, in one open; a pack's files are written by several threads, so that the file
system creates them in several folders at once. Restoring into a directory that already
holds some files keeps every file whose size and hash match. An object found missing or
damaged is marked broken (:func:`taskpoint.format.tree.mark_broken`), so that no later save
references it.

Where a restore of 200k files of 64 bytes spends its time (2-core VM, ext4, load average
7; ``bench/bench_many_files.py``): 17 to 22 s in all (37 s before files were created in
one open), of which 10 to 13 s creating and writing the files (6.5 s of it in the
kernel), 4 s reading, parsing and checking the manifest (50 MB of JSON, 2 s of CPU), 1 to
2 s checking and walking the entries, and 2 s recording each restored file's stat.

Example::

    restore_tree(store, manifest, Path("restored"))
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import tarfile
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import BinaryIO, NamedTuple

import xxhash

from taskpoint.errors import CheckpointCorruptError, CheckpointStoreError
from taskpoint.format import archive
from taskpoint.format._digest import Progress
from taskpoint.format._gc import paused
from taskpoint.format._statcache import StatCache
from taskpoint.format.manifest import Blob, Entry, Manifest
from taskpoint.format.retention import OBJECTS
from taskpoint.format.tree import MIN_WORKERS, content_hash, decode, mark_broken
from taskpoint.store.store import Store

__all__ = ["restore_tree", "swap_into", "verify_tree"]


class _Member(tarfile.TarInfo):
    """A manifest entry as the extractor's record, keeping the nanosecond mtime."""

    __slots__ = ("mtime_ns",)
    mtime_ns: int


_TYPES = {
    "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
}


def _members(entries: Iterable[Entry]) -> Iterator[tarfile.TarInfo]:
    for entry in entries:
        info = _Member(entry.path)
        info.mode = entry.mode
        info.mtime = entry.mtime_ns / 1e9
        info.mtime_ns = entry.mtime_ns
        info.type = _TYPES[entry.type]
        info.size = entry.size
        if entry.target is not None:
            info.linkname = entry.target
        yield info


class _Place(NamedTuple):
    """Where a blob goes: ``path``, at ``offset`` in the file (one per blob of a tree);
    ``new`` when the blob is the whole file, which does not exist yet (the extractor's
    ``create`` makes it, holding the blob)."""

    path: str
    offset: int
    blob: Blob
    new: bool = False


_Create = Callable[[str, "bytes | memoryview"], None]


def _fetch(store: Store, manifest: Manifest, name: str, url: str) -> bytes:
    key = f"{OBJECTS}/{name}"
    try:
        data = store.read_bytes(key)
    except FileNotFoundError:
        mark_broken(store, name)
        raise CheckpointCorruptError(
            f"checkpoint {url} needs object {store.url_of(key)}, which is missing", url=url
        ) from None
    expected = (manifest.objects or {}).get(name)
    if len(data) != expected or content_hash(data) != name:
        mark_broken(store, name)
        raise CheckpointCorruptError(
            f"object {store.url_of(key)} of checkpoint {url} is damaged: {len(data)} bytes "
            f"hashing to {content_hash(data)}, expected {expected} bytes hashing to {name}",
            url=url,
        )
    return data


def _blob_bytes(store: Store, data: bytes | memoryview, blob: Blob, url: str) -> bytes | memoryview:
    """The decoded bytes of ``blob``, which ``data`` holds whole, checked against its hash."""
    try:
        raw = decode(data, blob.codec) if blob.codec != "none" else data
    except Exception as exc:
        mark_broken(store, blob.object)
        raise CheckpointCorruptError(
            f"a blob of object {store.url_of(f'{OBJECTS}/{blob.object}')} of checkpoint "
            f"{url} cannot be decoded ({type(exc).__name__}: {exc}): the object is damaged",
            url=url,
        ) from exc
    if len(raw) != blob.size or content_hash(raw) != blob.hash:
        mark_broken(store, blob.object)
        raise CheckpointCorruptError(
            f"a blob of object {store.url_of(f'{OBJECTS}/{blob.object}')} of checkpoint "
            f"{url} does not match its hash {blob.hash}: the object is damaged",
            url=url,
        )
    return raw


_GAP = 2**20
"""Blobs of one object this close together are fetched by one read, gap included."""


def _spans(places: list[_Place]) -> list[tuple[int, int, list[_Place]]]:
    """The byte ranges of an object to read for ``places``, each with the places in it.

    Linear in ``places`` after sorting them: each place joins its span's list in place (a
    pack of small files holds thousands of blobs).
    """
    spans: list[tuple[int, int, list[_Place]]] = []
    end = -_GAP - 1
    members: list[_Place] = []
    for place in sorted(places, key=lambda p: p.blob.offset):
        start = place.blob.offset
        if spans and start - end <= _GAP:
            members.append(place)
            end = max(end, start + place.blob.length)
            spans[-1] = (spans[-1][0], end, members)
        else:
            members = [place]
            end = start + place.blob.length
            spans.append((start, end, members))
    return spans


def _read_span(
    store: Store, manifest: Manifest, name: str, start: int, end: int, url: str
) -> bytes:
    """Bytes ``start:end`` of object ``name``, by a ranged read even when they are the whole
    object: every blob in them is checked against its own hash, and a whole-object GET
    would have the S3 client check the object's checksum too, a second pass over every
    byte on the one thread that runs all transfers. An empty object is read whole (some
    backends refuse a range over nothing)."""
    key = f"{OBJECTS}/{name}"
    size = (manifest.objects or {}).get(name)
    try:
        data = store.read_range(key, start, end) if end > start else store.read_bytes(key)
    except FileNotFoundError:
        mark_broken(store, name)
        raise CheckpointCorruptError(
            f"checkpoint {url} needs object {store.url_of(key)}, which is missing", url=url
        ) from None
    if len(data) != end - start:
        mark_broken(store, name)
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
    create: _Create,
) -> None:
    """Check the blobs of ``members`` in ``data`` (an object's bytes from ``start`` on) and
    write each where it goes: a whole file by ``create``, a piece of one at its offset."""
    checked: dict[Blob, bytes | memoryview] = {}
    for place in members:
        blob = place.blob
        raw = checked.get(blob)
        if raw is None:
            at = blob.offset - start
            raw = checked[blob] = _blob_bytes(store, data[at : at + blob.length], blob, url)
        if place.new:
            create(place.path, raw)
        else:
            fd = os.open(place.path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                archive.write_at(fd, raw, place.offset)
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
        mark_broken(store, name)
        raise CheckpointCorruptError(
            f"checkpoint {url} needs object {store.url_of(key)}, which is missing", url=url
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            mark_broken(store, name)
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


_BATCH = 256
"""Places one thread writes in a row. A pack of small files holds thousands of blobs: its
bytes, fetched once, are shared by several threads writing a batch each, so that the
file system creates files in several directories at once (outside the GIL)."""


def _download(
    store: Store,
    manifest: Manifest,
    places: dict[str, list[_Place]],
    url: str,
    workers: int,
    progress: Progress | None,
    create: _Create,
) -> None:
    """Fetch what each object of ``places`` holds for them and write its blobs where they go.

    An object is read whole when its blobs cover it (a pack written by one save), else by
    ranged reads of the stretches they lie in. Every blob is checked against its hash,
    which covers every byte written (an object's own hash would only add a second pass).
    What one read brings is written by up to ``workers`` threads, :data:`_BATCH` places
    each.
    """
    jobs = [
        (name, start, end, members)
        for name, of_object in places.items()
        for start, end, members in _spans(of_object)
    ]

    with ThreadPoolExecutor(workers, thread_name_prefix="taskpoint-write") as writers:

        def one(index: str) -> None:
            name, start, end, members = jobs[int(index)]
            local = store.local_path(f"{OBJECTS}/{name}")
            fetched: contextlib.AbstractContextManager[memoryview]
            if local is not None:
                fetched = _mapped(store, manifest, name, local, url)
                start = 0
            else:
                fetched = contextlib.nullcontext(
                    memoryview(_read_span(store, manifest, name, start, end, url))
                )
            with fetched as data:
                if len(members) <= _BATCH:
                    _place(store, data, start, members, url, progress, create)
                    return
                _wait_all([
                    writers.submit(
                        _place, store, data, start, members[i : i + _BATCH], url, progress,
                        create,
                    )
                    for i in range(0, len(members), _BATCH)
                ])

        _run_all(workers, one, [str(i) for i in range(len(jobs))])


def _wait_all(futures: list[Future[None]]) -> None:
    """Wait for ``futures``; the first failure is raised once the others have stopped
    (those not started are cancelled), so that none outlives what they share."""
    try:
        for future in futures:
            future.result()
    except BaseException:
        for future in futures:
            future.cancel()
        wait(futures)
        raise


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


def verify_tree(store: Store, manifest: Manifest, *, workers: int = MIN_WORKERS) -> bool:
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
        _run_all(max(workers, MIN_WORKERS), one, by_object)
    except CheckpointStoreError:
        raise
    except CheckpointCorruptError:
        return False
    return True


def _present(base: Path, entries: Iterable[Entry]) -> dict[str, tuple[Path, os.stat_result]]:
    """The file entries that are regular files at ``base/path`` reached through real
    directories only, by path, each with its path and ``lstat``.

    Each directory is looked at once, however many entries lie in it. The paths are a
    manifest's, not yet checked by the extractor: one no path can name (a NUL in it) or
    climbing with ``..`` is not present, and the extractor refuses it next.
    """
    root = os.fspath(base)
    real: dict[tuple[str, ...], bool] = {(): True}  # directories below base, by parts

    def is_real(parts: tuple[str, ...]) -> bool:
        known = len(parts)
        while parts[:known] not in real:  # the deepest ancestor already looked at
            known -= 1
        ok = real[parts[:known]]
        for depth in range(known + 1, len(parts) + 1):  # then each directory below it
            if ok:
                try:
                    ok = stat.S_ISDIR(os.lstat(os.path.join(root, *parts[:depth])).st_mode)
                except (OSError, ValueError):
                    ok = False
            real[parts[:depth]] = ok
        return ok

    found: dict[str, tuple[Path, os.stat_result]] = {}
    for entry in entries:
        if entry.type != "file":
            continue
        parts = tuple(p for p in entry.path.split("/") if p not in ("", "."))
        if not parts or ".." in parts or not is_real(parts[:-1]):
            continue
        path = os.path.join(root, *parts)
        try:
            st = os.lstat(path)
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(st.st_mode):
            found[entry.path] = (Path(path), st)
    return found


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
    content is taken without being read (see :mod:`taskpoint.format._statcache`); any other is
    hashed.
    """
    if existing is None:
        return {}
    present = _present(existing, entries)
    candidates = {rel: path for rel, (path, _) in present.items()}
    by_path = {e.path: e for e in entries}
    found: dict[str, Path] = {}
    if seen is not None:
        for rel, (_, st) in present.items():
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
    by_path = {e.path: e for e in entries if e.type == "file"}
    places: dict[str, list[_Place]] = defaultdict(list)
    kept: list[tuple[Path, Path]] = []
    empty: list[str] = []
    walk = paused()  # objects per entry, until the downloads begin: see taskpoint.format._gc
    keep: dict[str, Path] = {}

    def deferred(member: tarfile.TarInfo, path: str) -> bool:
        """Leave a file of at most one blob to ``fill``, which creates it with its bytes."""
        if member.name in keep:
            return False
        blobs = by_path[member.name].blobs
        if len(blobs) > 1:
            return False
        if blobs:
            places[blobs[0].object].append(_Place(path, 0, blobs[0], True))
        else:
            empty.append(path)
        return True

    def write(member: tarfile.TarInfo, path: Path, out: BinaryIO) -> None:
        if member.name in keep:
            kept.append((keep[member.name], path))
            return
        # The file grows as its checked blobs are written: nothing is allocated for what
        # the manifest merely claims.
        offset = 0
        for blob in by_path[member.name].blobs:
            places[blob.object].append(_Place(os.fspath(path), offset, blob, False))
            offset += blob.size

    def fill() -> None:
        walk.end()
        for source, path in kept:
            _adopt(source, path)
        for name in empty:
            extractor.create(name, b"")
        _download(store, manifest, places, url, workers, progress, extractor.create)

    try:
        keep.update(_reusable(existing, entries, workers, seen))
        dest.mkdir(parents=True, exist_ok=True)
        extractor = archive.Extractor(_members(entries), dest, write, deferred)
        extractor.run(fill)
    finally:
        walk.end()
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


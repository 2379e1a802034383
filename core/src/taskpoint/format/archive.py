"""Directory trees to and from one streamed, compressed tar archive.

Packing streams the tree through tar and a compressor straight into a writable binary
stream; unpacking streams the other way. Neither holds more than a few blocks in memory
nor writes an intermediate file.

Codecs:
    ``gzip`` (default): a multi-member gzip stream, written by a thread pool in 1 MiB
        members. A member whose data does not compress (fp32 weights, say) is stored
        uncompressed, so packing and unpacking run near copy speed; others are deflated
        at a low level (python-isal). Any ``tar xzf`` reads it.
    ``zstd``: multi-threaded zstandard; needs ``pip install "taskpoint[zstd]"``.
    ``none``: a plain tar.

What a tree may hold: regular files, directories (empty ones too), hard links and symbolic
links whose target stays inside the tree. Modes and modification times round-trip; owners
do not. Anything else is refused with :class:`~taskpoint.CheckpointUnsafeError`, when packing
and again when unpacking, and nothing is written outside the restore directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import struct
import tarfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

from taskpoint.errors import CheckpointUnsafeError
from taskpoint.format.manifest import CODECS, Codec

__all__ = [
    "Extractor",
    "check_codec",
    "check_tree",
    "gzip_bytes",
    "import_zstandard",
    "pack_directory",
    "unpack_directory",
    "walk_tree",
    "worth_compressing",
    "write_at",
]

_GZIP_LEVEL = 1
_ZSTD_LEVEL = 3
_BLOCK = 1024 * 1024


def check_codec(codec: str) -> Codec:
    """Return ``codec`` if it names a usable codec.

    Raises:
        ValueError: ``codec`` is not one of ``gzip``, ``zstd``, ``none``.
        ImportError: ``zstd`` was asked for but ``zstandard`` is not installed.
    """
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}; got {codec!r}")
    if codec == "zstd":
        import_zstandard()
    return codec


def import_zstandard() -> Any:
    """The ``zstandard`` module, imported on first use (it is an optional dependency).

    Raises:
        ImportError: ``zstandard`` is not installed; the message says how to install it.
    """
    try:
        import zstandard
    except ImportError as exc:
        raise ImportError(
            'codec="zstd" needs the zstandard package: pip install "taskpoint[zstd]"'
        ) from exc
    return zstandard


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@contextlib.contextmanager
def _compressing(out: BinaryIO, codec: Codec) -> Iterator[BinaryIO]:
    if codec == "none":
        yield out
        return
    if codec == "gzip":
        writer: Any = _GzipMembersWriter(out, _threads())
    else:
        writer = import_zstandard().ZstdCompressor(level=_ZSTD_LEVEL, threads=-1).stream_writer(
            out, closefd=False
        )
    try:
        yield cast(BinaryIO, writer)
    finally:
        writer.close()


@contextlib.contextmanager
def _decompressing(src: BinaryIO, codec: Codec) -> Iterator[BinaryIO]:
    if codec == "none":
        yield src
        return
    if codec == "gzip":
        from isal import igzip_threaded

        reader: Any = igzip_threaded.open(  # type: ignore[no-untyped-call]
            src, "rb", threads=1, block_size=_BLOCK
        )
    else:
        reader = import_zstandard().ZstdDecompressor().stream_reader(src, closefd=False)
    try:
        yield cast(BinaryIO, reader)
        # Read past the tar end-of-archive blocks so the codec checks its trailer
        # (gzip CRC, zstd frame) and the caller's digest sees every stored byte.
        while reader.read(_BLOCK):
            pass
    finally:
        reader.close()


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, OS unknown
_STORED_MAX = 65535
_SAMPLE = 64 * 1024
_INCOMPRESSIBLE = 0.9
"""A block whose sample deflates to more than this fraction of its size is stored."""


def worth_compressing(block: bytes | memoryview) -> bool:
    """Whether deflating ``block`` pays, judged by a cheap sample of its first 64 KiB.

    Text, JSON and sparse arrays do; fp32 weights and already-compressed data do not.
    """
    from isal import isal_zlib

    sample = block[:_SAMPLE]
    return len(isal_zlib.compress(sample, _GZIP_LEVEL)) < _INCOMPRESSIBLE * len(sample)


def gzip_bytes(block: bytes | memoryview) -> bytes:
    """``block`` as one gzip member, deflated at taskpoint's (fast) level."""
    from isal import igzip

    return bytes(igzip.compress(block, compresslevel=_GZIP_LEVEL))


def _gzip_member(block: bytes) -> bytes:
    """One complete gzip member holding ``block``: deflated, or stored if that gains little."""
    from isal import isal_zlib

    if worth_compressing(block):
        return gzip_bytes(block)
    view = memoryview(block)
    parts: list[bytes | memoryview] = [_GZIP_HEADER]
    for offset in range(0, len(block), _STORED_MAX):
        chunk = view[offset : offset + _STORED_MAX]
        final = 1 if offset + _STORED_MAX >= len(block) else 0
        parts.append(struct.pack("<BHH", final, len(chunk), len(chunk) ^ 0xFFFF))
        parts.append(chunk)
    parts.append(struct.pack("<II", isal_zlib.crc32(block), len(block) & 0xFFFFFFFF))
    return b"".join(parts)


class _GzipMembersWriter:
    """Splits what is written into :data:`_BLOCK`-sized gzip members, made in parallel.

    Members are written to ``out`` in order; at most ``2 * threads`` blocks are in flight,
    so memory stays bounded. ``close`` flushes the rest and does not close ``out``.
    """

    def __init__(self, out: BinaryIO, threads: int) -> None:
        self._out = out
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="taskpoint-gzip")
        self._pending: deque[Future[bytes]] = deque()
        self._limit = 2 * threads
        self._buffer = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._buffer += data
        while len(self._buffer) >= _BLOCK:
            self._submit(bytes(self._buffer[:_BLOCK]))
            del self._buffer[:_BLOCK]
        return len(data)

    def _submit(self, block: bytes) -> None:
        if len(self._pending) >= self._limit:
            self._out.write(self._pending.popleft().result())
        self._pending.append(self._pool.submit(_gzip_member, block))

    def flush(self) -> None:
        """Nothing to do: members are written as they complete."""

    def close(self) -> None:
        try:
            if self._buffer:
                self._submit(bytes(self._buffer))
                self._buffer.clear()
            while self._pending:
                self._out.write(self._pending.popleft().result())
        finally:
            for future in self._pending:
                future.cancel()
            self._pool.shutdown(wait=True)


def walk_tree(root: Path) -> Iterator[Path]:
    """Every path below ``root``, parents before children, in a stable order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        for name in dirnames:
            yield base / name
        for name in sorted(filenames):
            yield base / name


def _check_entry(root: Path, path: Path) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        resolved = os.path.normpath(os.path.join(path.parent, target))
        if os.path.isabs(target) or os.path.commonpath([resolved, str(root)]) != str(root):
            raise CheckpointUnsafeError(
                f"cannot checkpoint {root}: symbolic link {path} points outside the tree "
                f"(to {target!r}); only relative links inside the directory are kept"
            )
    elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise CheckpointUnsafeError(
            f"cannot checkpoint {root}: {path} is not a regular file, directory or "
            "symbolic link (devices, sockets and FIFOs are not stored)"
        )


def check_tree(root: Path) -> None:
    """Raise CheckpointUnsafeError if the tree under ``root`` cannot be archived safely."""
    root = Path(os.path.abspath(root))
    for path in walk_tree(root):
        _check_entry(root, path)


def pack_directory(root: Path, out: BinaryIO, codec: Codec = "gzip") -> None:
    """Write the tree under ``root`` to ``out`` as a tar archive encoded with ``codec``.

    Entry names are relative to ``root`` (``./`` is not stored). ``out`` is not closed.

    Raises:
        CheckpointUnsafeError: the tree holds a special file or a link leaving it.
    """
    root = Path(os.path.abspath(root))
    check_tree(root)  # refuse before writing anything
    with _compressing(out, codec) as stream, tarfile.open(
        fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT, bufsize=_BLOCK
    ) as tar:
        # The 16 KiB default copy size makes tar's stream buffering quadratic.
        tar.copybufsize = _BLOCK  # type: ignore[attr-defined]
        for path in walk_tree(root):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)


_WINDOWS = os.name == "nt"
"""Where a name can be absolute without a leading ``/`` (``C:x``, ``\\\\server``)."""

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(
    os, "O_BINARY", 0
)
"""A regular file made new: never one that exists, nor through a link at its name."""

_MAX_LINK_HOPS = 40
"""Links followed while resolving one path before it counts as a loop (Linux's limit)."""


def _refuse(member: tarfile.TarInfo, why: str) -> CheckpointUnsafeError:
    return CheckpointUnsafeError(f"refusing archive entry {member.name!r}: {why}")


def _member_parts(member: tarfile.TarInfo) -> tuple[str, ...]:
    """The entry's path components, refusing absolute, climbing and odd names."""
    name = member.name
    if "\x00" in name:
        raise _refuse(member, "NUL in the name")
    if name.startswith("/") or (_WINDOWS and (os.path.isabs(name) or os.path.splitdrive(name)[0])):
        raise _refuse(member, "absolute path")
    parts = tuple(name.split("/"))
    if "" in parts or "." in parts:
        parts = tuple(p for p in parts if p not in ("", "."))
    if not parts:
        raise _refuse(member, "empty name")
    if ".." in parts:
        raise _refuse(member, "the name climbs out with '..'")
    return parts


def _mtime_ns(member: tarfile.TarInfo) -> int:
    ns = getattr(member, "mtime_ns", None)
    return ns if isinstance(ns, int) else int(member.mtime * 1_000_000_000)


class Extractor:
    """Writes archive entries under ``dest`` with taskpoint's own checks, never tarfile's.

    The entries are ``tarfile.TarInfo`` records, from a tar archive or built from a
    format-2 manifest; ``write(member, path, out)`` fills each regular file (created
    empty, exclusively, without following links) and may defer the bytes to ``fill``.
    A file for which ``deferred(member, path)`` answers true is not created during the
    walk: ``fill`` creates it, holding its bytes, with :meth:`create` (one open, write and
    close, where creating it empty and writing it later opens it twice).

    Python's ``tarfile`` filters have been unsound on many releases (a symlink chain
    longer than ``PATH_MAX`` escapes the ``data`` filter: CVE-2025-4517), so nothing here
    relies on them or on ``os.path.realpath``. The rules, which hold whatever the
    archive's order:

    - names are relative, without ``..``, and each at most once;
    - nothing is written through a symbolic link: every parent of an entry must be a
      real directory that this extraction created;
    - hard links point at a regular file extracted earlier;
    - symbolic links are created last, each resolved component by component inside
      ``dest`` (following the links already there, at most 40 hops); one that leaves
      ``dest`` or loops is refused and the links already made are removed;
    - only regular files, directories and links are accepted.

    The checks cost a few dictionary lookups per entry, and a directory's checks are made
    once, when it is first met: a tree of many small files is limited by the file
    system's own cost of creating them.
    """

    def __init__(
        self,
        members: Iterable[tarfile.TarInfo],
        dest: Path,
        write: Callable[[tarfile.TarInfo, Path, BinaryIO], None],
        deferred: Callable[[tarfile.TarInfo, str], bool] | None = None,
    ) -> None:
        self._members = members
        self._prefix = os.path.join(os.fspath(dest), "")
        self._write = write
        self._deferred = deferred
        self._seen: dict[tuple[str, ...], str] = {(): "dir"}
        self._dirs: list[tuple[str, tarfile.TarInfo]] = []
        self._files: list[tuple[str, tarfile.TarInfo]] = []
        self._links: list[tuple[tuple[str, ...], tarfile.TarInfo]] = []
        self._pending: dict[str, tarfile.TarInfo] = {}
        self._late_links: list[tuple[str, str]] = []

    def run(self, fill: Callable[[], None] | None = None) -> None:
        """Check and create every entry; ``fill`` runs once all exist (but the files
        ``deferred`` left to it, and hard links to those), before modes and times are set
        (a caller that writes file contents later waits for them there).

        Raises:
            CheckpointUnsafeError: an entry breaks a rule above. Nothing is written for it.
            RuntimeError: ``fill`` returned without creating every deferred file.
            OSError: creating an entry failed.
        """
        seen = self._seen
        for member in self._members:
            parts = _member_parts(member)
            if parts in seen and not (member.isdir() and seen[parts] == "dir"):
                raise _refuse(member, "a second entry with the same name")
            if seen.get(parts[:-1]) != "dir":
                self._make_parents(member, parts[:-1])
            if member.isreg():
                self._file(member, parts)
            elif member.isdir():
                self._directory(member, parts)
            elif member.islnk():
                self._hard_link(member, parts)
            elif member.issym():
                seen[parts] = "sym"
                self._links.append((parts, member))
            else:
                raise _refuse(member, "not a regular file, directory or link")
        self._symlinks()
        if fill is not None:
            fill()
        if self._pending:
            raise RuntimeError(
                f"{len(self._pending)} files left to fill were not created, "
                f"{next(iter(self._pending))!r} among them"
            )
        for target, path in self._late_links:
            os.link(target, path, follow_symlinks=False)
        for path, member in self._files:
            os.chmod(path, member.mode & 0o777)
            mtime_ns = _mtime_ns(member)
            os.utime(path, ns=(mtime_ns, mtime_ns))
        for path, member in reversed(self._dirs):  # children first: their writes are done
            os.chmod(path, member.mode & 0o777)
            os.utime(path, (member.mtime, member.mtime))

    def create(self, path: str, data: bytes | memoryview) -> None:
        """Create the file at ``path``, which ``deferred`` left to ``fill``, holding
        ``data``, with its entry's mode and modification time. Safe to call from several
        threads, each file once.

        Raises:
            ValueError: no file at ``path`` was left to fill, or it was created already.
            OSError: creating or writing the file failed (one already there included).
        """
        member = self._pending.pop(path, None)
        if member is None:
            raise ValueError(f"{path!r} is not a file left to fill, or was created already")
        fd = os.open(path, _CREATE, 0o600)
        try:
            write_at(fd, data)
            # Set through the descriptor: the mode applies to later opens only (a file
            # made read-only is written all the same), and nothing writes it afterwards.
            os.fchmod(fd, member.mode & 0o777)
            mtime_ns = _mtime_ns(member)
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)

    def _path(self, parts: tuple[str, ...]) -> str:
        return self._prefix + "/".join(parts)  # checked parts: neither empty nor absolute

    def _make_parents(self, member: tarfile.TarInfo, parents: tuple[str, ...]) -> None:
        for depth in range(1, len(parents) + 1):
            prefix = parents[:depth]
            kind = self._seen.get(prefix)
            if kind == "dir":
                continue
            if kind is not None:
                raise _refuse(member, f"its parent {'/'.join(prefix)!r} is not a directory")
            os.mkdir(self._path(prefix), 0o755)
            self._seen[prefix] = "dir"

    def _directory(self, member: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        path = self._path(parts)
        if parts not in self._seen:
            os.mkdir(path, 0o700)
            self._seen[parts] = "dir"
        self._dirs.append((path, member))

    def _file(self, member: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        path = self._path(parts)
        if self._deferred is not None and self._deferred(member, path):
            self._pending[path] = member
        else:
            fd = os.open(path, _CREATE, 0o600)
            with os.fdopen(fd, "wb") as out:
                self._write(member, Path(path), cast(BinaryIO, out))
            self._files.append((path, member))
        self._seen[parts] = "file"

    def _hard_link(self, member: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        target = tarfile.TarInfo(member.linkname)
        target_parts = _member_parts(target)
        if self._seen.get(target_parts) != "file":
            raise _refuse(member, "a hard link to something other than a file extracted before it")
        source, path = self._path(target_parts), self._path(parts)
        if source in self._pending:  # made once fill has created it
            self._late_links.append((source, path))
        else:
            os.link(source, path, follow_symlinks=False)
        self._seen[parts] = "file"

    def _symlinks(self) -> None:
        made: list[str] = []
        try:
            for parts, member in self._links:
                self._check_link_text(member)
                path = self._path(parts)
                os.symlink(member.linkname, path)
                made.append(path)
            for parts, member in self._links:
                if self._resolve(parts, member) is None:
                    raise _refuse(member, f"the link to {member.linkname!r} leaves the tree")
        except BaseException:
            for path in made:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise

    @staticmethod
    def _check_link_text(member: tarfile.TarInfo) -> None:
        target = member.linkname
        if not target or "\x00" in target or os.path.isabs(target) or target.startswith("/"):
            raise _refuse(member, f"a link to {target!r}; only relative links inside the tree")

    def _resolve(
        self, parts: tuple[str, ...], member: tarfile.TarInfo
    ) -> tuple[str, ...] | None:
        """Where the link at ``parts`` leads inside ``dest``; ``None`` if it leaves it.

        Resolves lexically over what this extraction wrote (never the file system's
        own resolution), so the answer cannot depend on ``PATH_MAX``.
        """
        hops = 0
        pending = list(reversed(self._link_steps(parts[:-1], member.linkname)))
        here: list[str] = []
        while pending:
            step = pending.pop()
            if step == "..":
                if not here:
                    return None
                here.pop()
                continue
            candidate = (*here, step)
            if self._seen.get(candidate) == "sym":
                hops += 1
                if hops > _MAX_LINK_HOPS:
                    return None
                link = os.readlink(self._path(candidate))
                pending.extend(reversed(self._link_steps(tuple(here), link)[len(here):]))
                continue
            here.append(step)
        return tuple(here)

    @staticmethod
    def _link_steps(base: tuple[str, ...], target: str) -> list[str]:
        """``base`` followed by ``target``'s components, ``.`` and empty ones dropped."""
        return [*base, *(p for p in target.split("/") if p not in ("", "."))]


def write_at(fd: int, data: bytes | memoryview, offset: int = 0) -> None:
    """Write all of ``data`` to ``fd`` at ``offset``, however many calls that takes.

    A write the disk takes only in part (a file size limit or a full disk reached midway)
    is continued, so the disk's refusal raises instead of leaving the file short.

    Raises:
        OSError: the disk refused the write.
    """
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class _ForwardReader:
    """A stream that ``tarfile``'s random-access reader can use: it seeks forward only.

    tarfile's stream mode (``r|``) joins and slices every read in its own buffer, three
    copies of each byte; its random-access mode (``r:``) reads member data straight from
    the file object, but needs ``tell`` and ``seek``. Reading a tar front to back only ever
    seeks forward, which this serves by reading and dropping bytes.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._pos = 0

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            pos += self._pos
        elif whence != os.SEEK_SET or pos < self._pos:
            raise io.UnsupportedOperation("a streamed archive can only be read front to back")
        while self._pos < pos and self.read(min(pos - self._pos, _BLOCK)):
            pass
        return self._pos

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that is left when negative); fewer only at the end."""
        data = self._raw.read(size)
        if 0 < len(data) < size:
            parts = [data]
            got = len(data)
            while got < size and (more := self._raw.read(size - got)):
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self._pos += len(data)
        return data


def unpack_directory(src: BinaryIO, dest: Path, codec: Codec = "gzip") -> None:
    """Extract a tar archive encoded with ``codec`` from ``src`` into ``dest``.

    ``dest`` is created if missing. ``src`` is read to its end and not closed.

    Entries are checked by taskpoint itself (see :class:`Extractor`), whatever Python's
    own ``tarfile`` filters would allow.

    Raises:
        CheckpointUnsafeError: an entry is absolute, climbs out with ``..``, is named
            twice, would be written through a link, links outside ``dest``, or is a
            device or other special file. Entries before it may have been written
            inside ``dest``, never outside it.
        tarfile.TarError, EOFError: the stream is not a valid archive.
        OSError: the stream is not a valid archive, or writing under ``dest`` failed
            (one with an ``errno``: a full disk, a file too large, a refused permission).
    """
    dest.mkdir(parents=True, exist_ok=True)
    with _decompressing(src, codec) as stream, tarfile.open(
        fileobj=cast(BinaryIO, _ForwardReader(stream)), mode="r:"
    ) as tar:
        Extractor(tar, dest, _copy_member(tar)).run()


def _copy_member(tar: tarfile.TarFile) -> Callable[[tarfile.TarInfo, Path, BinaryIO], None]:
    def write(member: tarfile.TarInfo, path: Path, out: BinaryIO) -> None:
        source = tar.extractfile(member)
        assert source is not None  # a regular file always has data
        left = member.size
        while left > 0:
            block = source.read(min(left, _BLOCK))
            if not block:
                raise EOFError(f"archive entry {member.name!r} is cut short")
            out.write(block)
            left -= len(block)

    return write

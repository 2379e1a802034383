"""The manifest: what a committed checkpoint is, as stored next to its payload.

A manifest is a small JSON object written *after* its payload; writing it is the commit.
This module builds, names, serialises and validates manifests. It performs no I/O.

Format 1 (``"format": 1``)::

    {
      "format": 1,
      "kind": "bytes" | "file" | "directory",
      "name": "training.pt",          # file or directory name; null for bytes
      "codec": "gzip" | "zstd" | "none",  # how the payload is encoded (directories only
                                      # use a compressed tar; bytes and files are "none")
      "size": 1234,                   # stored payload size, in bytes
      "checksum": "xxh3-128:<hex>",   # over the stored payload bytes ("sha256:<hex>"
                                      # is read too)
      "payload": "000001-000000004-3f2a9c1d.payload",  # key relative to checkpoints/,
                                      # named for this manifest's attempt and seq
      "attempt": 1, "seq": 4,         # which attempt committed it, and its save number
      "created": 1764412345.123,      # Unix time in seconds, from the writer's clock
      "stats": {"save_s": 0.8, "upload_s": 0.7, "uploaded": 1234, "reused": 0,
                "blocked_s": 0.1, "background": true},  # optional: what the save cost
      "step": 1200,                   # optional: the training step reported when the
                                      # save was called (taskpoint.report_step)
      "preemption": true              # optional, only when true: saved after the
                                      # process received its preemption signal
    }

Format 2 (``"format": 2``) is how directories are stored from taskpoint 0.2 on: no
``payload``, no ``codec``; instead every path of the tree and the content objects it uses
(bytes and single files keep format 1 manifests)::

    {
      "format": 2, "kind": "directory", "name": "run-state",
      "size": 16392,                  # bytes of file content in the tree
      "checksum": "xxh3-128:<hex>",   # over the canonical JSON of "entries"
      "attempt": 1, "seq": 4, "created": 1764412345.1, "stats": {...},
      "objects": {"<xxh3-128 hex>": 16400},   # every object used, and its stored size
      "entries": [                    # parents before children, each path once
        {"path": "weights", "type": "dir", "mode": 493, "mtime_ns": 1700000000000000000},
        {"path": "weights/model.bin", "type": "file", "mode": 420, "mtime_ns": ...,
         "size": 16384, "hash": "xxh3-128:<hex>",
         "blobs": [["<object>", 0, 16400, "gzip", 16384, "<xxh3-128 hex>"]]},
        {"path": "latest", "type": "symlink", "target": "weights/model.bin"},
        {"path": "copy.bin", "type": "hardlink", "target": "weights/model.bin"}
      ]
    }

A tree written by several processes at once (:meth:`taskpoint.Checkpoint.save_part_sync`)
also records which writer contributed each path, by rank (a path two writers contributed
with the same content is listed under both); a reader that does not know ``parts`` restores
the whole tree::

      "parts": {"0": ["weights", "weights/__0_0.distcp", ".metadata"],
                "1": ["weights", "weights/__1_0.distcp"]}

A file's ``blobs`` are its content in order: ``[object, offset, length, codec, size, hash]``
says that ``length`` bytes at ``offset`` of ``objects/<object>``, decoded with ``codec``
(``none``, ``gzip`` or ``zstd``), are ``size`` bytes of the file whose XXH3-128 is ``hash``.
An object's name is the XXH3-128 of its stored bytes.

Sizes are checked against each other before anything is restored: a blob lies inside its
object (``offset + length`` at most the object's size); a file's ``size`` is the sum of its
blobs' sizes, and the tree's ``size`` the sum of its files'; a blob stored as is (``none``)
has ``size == length``, and a compressed one at most :data:`MAX_EXPANSION` times its
``length`` (the most its codec's format can expand). A path, and a link's target, is shorter
than :data:`PATH_MAX` bytes, and each component of a path at most :data:`NAME_MAX`. A manifest
that breaks one of these rules was not written by a save: it is damaged, and a load falls
back past it rather than asking the local disk for what no save could have stored.

A manifest is read under its name: one whose ``attempt`` and ``seq`` (or whose payload's
name) are another save's is corrupt, since retention keeps checkpoints by name.

Readers ignore fields they do not know, so optional fields such as ``stats`` stay format 1.
Records are parsed by :func:`loads_record`, which bounds what a hostile store can make a
reader do: integers of at most 64 digits, no NaN or infinities (nor numbers such as
``1e999`` that overflow to one), nesting below Python's recursion limit; anything else
reads as not valid JSON.

Manifests are named ``<attempt:06d>-<seq:09d>.manifest.json`` so that sorting names sorts
checkpoints from oldest to newest: by attempt, then by save order within the attempt.

The same format number versions the rest of an action's layout: attempt markers and the
status record carry ``"format"`` too (a record without one is format 1), and
:func:`check_format` refuses anything newer than :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from taskpoint.errors import (
    CheckpointCoordinationError,
    CheckpointCorruptError,
    CheckpointFormatError,
)
from taskpoint.format._gc import paused

__all__ = [
    "BLOB_CODECS",
    "CHECKPOINTS",
    "CODECS",
    "FORMAT_VERSION",
    "KINDS",
    "MAX_EXPANSION",
    "NAME_MAX",
    "PATH_MAX",
    "TREE_FORMAT",
    "Blob",
    "Entry",
    "Manifest",
    "check_format",
    "check_paths",
    "loads_record",
    "manifest_name",
    "parse_entries",
    "parse_manifest_name",
    "parse_payload_name",
    "payload_name",
]

CHECKPOINTS = "checkpoints"
"""The folder, under a checkpoint's URL, that holds manifests and format-1 payloads."""
FORMAT_VERSION = 2
"""The store format (manifests, attempt markers, status record) this version writes, and the
newest it reads. Bytes and single files are still committed with format 1 manifests."""

TREE_FORMAT = 2
"""The first format that stores a directory as content objects (see the module docstring)."""

Kind = Literal["bytes", "file", "directory"]
Codec = Literal["gzip", "zstd", "none"]
KINDS: tuple[Kind, ...] = ("bytes", "file", "directory")
CODECS: tuple[Codec, ...] = ("gzip", "zstd", "none")

_SUFFIX = ".manifest.json"
_HEX_RE = re.compile(r"[0-9a-f]{32}")
BLOB_CODECS: tuple[Codec, ...] = ("none", "gzip", "zstd")
ENTRY_TYPES = ("file", "dir", "symlink", "hardlink")
_CHECKSUM_RE = re.compile(r"xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64}")
_NAME_RE = re.compile(r"^(\d{6,})-(\d{9,})\.manifest\.json$")
_PAYLOAD_RE = re.compile(r"^(\d{6,})-(\d{9,})-[^-/]+\.payload$")


_MAX_DIGITS = 64


_DIGIT_CLASSES = bytes(0x30 if 0x30 <= b <= 0x39 else 0x78 for b in range(256))
"""A translation of bytes that keeps ``0`` for an ASCII digit and makes any other ``x``."""
_LONG_RUN = b"0" * (_MAX_DIGITS + 1)
_SCAN = 8 * 2**20


def _has_long_digits(data: bytes) -> bool:
    """Whether ``data`` holds more than ``_MAX_DIGITS`` ASCII digits in a row.

    Looks for a run in a translation of ``data``, 8 MiB at a time (the overlap catches a
    run across two): ``re.search(rb"\\d{65}")`` tried a match at every digit, 30 MB/s,
    1.6 s of a 200k-file manifest.
    """
    for start in range(0, len(data), _SCAN):
        if _LONG_RUN in data[start : start + _SCAN + _MAX_DIGITS].translate(_DIGIT_CLASSES):
            return True
    return False


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 is valid JSON, but overflows to infinity
        raise ValueError(f"{text[:20]!r} overflows a float")
    return value


def loads_record(data: bytes) -> object:
    """Parse a JSON record read from a store that may be damaged or hostile.

    Raises:
        ValueError: ``data`` is not UTF-8 JSON, holds an integer of more than 64 digits,
            NaN, an infinity or a number too large for a float, or nests too deeply to parse.
    """
    # Integers are bounded by a Python call each only where some run of ASCII digits (in a
    # number or in a string) is long enough to matter, or where JSON's UTF-16 or UTF-32
    # hides them: a tree's manifest holds several integers per file, and one call per
    # integer was a tenth of a large tree's restore.
    plain = isinstance(data, bytes) and json.detect_encoding(data).startswith("utf-8")
    bounded = int if plain and not _has_long_digits(data) else _parse_int
    try:
        return json.loads(
            data, parse_int=bounded, parse_float=_parse_float, parse_constant=_refuse_constant
        )
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None


def check_format(record: object, *, url: str) -> None:
    """Refuse a JSON record (manifest, attempt marker, status) written in a newer format.

    A record without an integer ``"format"`` passes: the layout before the field was format 1,
    and malformed records are for the caller to judge.

    Raises:
        CheckpointFormatError: ``record["format"]`` is newer than :data:`FORMAT_VERSION`.
    """
    fmt = record.get("format") if isinstance(record, dict) else None
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{url} was written in taskpoint store format {fmt}, but this taskpoint reads "
            f"formats up to {FORMAT_VERSION}: upgrade taskpoint to use it"
        )


_PATHS_ACCEPTED = (
    "paths must be a collection (list, tuple, set) of relative paths inside the tree, "
    "with '/' between components and no '', '.' or '..' component (such as "
    "'weights/model.bin'; a trailing '/' is dropped), or None for the whole tree"
)


def check_paths(paths: object) -> frozenset[str]:
    """Validate the ``paths`` a restore is asked for (see :meth:`Manifest.only_paths`).

    Returns:
        The paths, each without a trailing ``/``.

    Raises:
        ValueError: ``paths`` is a string or not a collection, or one of them is not a
            string, is empty or absolute, or has an empty, ``.`` or ``..`` component or a
            NUL (the message says what is accepted).
    """
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Collection):
        raise ValueError(f"{_PATHS_ACCEPTED}; got {paths!r}")
    checked: set[str] = set()
    for path in paths:
        if isinstance(path, str) and path.endswith("/") and path != "/":
            path = path[:-1]
        if (
            not isinstance(path, str) or "\x00" in path
            or any(part in ("", ".", "..") for part in path.split("/"))
        ):
            raise ValueError(f"{_PATHS_ACCEPTED}; got {path!r} in {paths!r}")
        checked.add(path)
    return frozenset(checked)


def manifest_name(attempt: int, seq: int) -> str:
    """The manifest's object name for save ``seq`` of ``attempt``."""
    return f"{attempt:06d}-{seq:09d}{_SUFFIX}"


def payload_name(attempt: int, seq: int, token: str) -> str:
    """The payload's object name; ``token`` keeps concurrent writers apart."""
    return f"{attempt:06d}-{seq:09d}-{token}.payload"


def parse_payload_name(name: str) -> tuple[int, int] | None:
    """``(attempt, seq)`` for a payload object name, or ``None`` for any other name."""
    match = _PAYLOAD_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def parse_manifest_name(name: str) -> tuple[int, int] | None:
    """``(attempt, seq)`` for a manifest object name, or ``None`` for any other name."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Manifest:
    """One committed checkpoint, as its manifest records it (what
    :meth:`taskpoint.Checkpoint.committed` lists, newest first). The stored JSON is
    described in the module docstring and on the store format page.

    Attributes:
        kind: what was saved: ``"bytes"``, ``"file"`` or ``"directory"``.
        name: the file's or directory's name; ``None`` for bytes.
        codec: how a format-1 payload is encoded (``"gzip"``, ``"zstd"``, ``"none"``).
        size: bytes: the stored payload's (format 1), or the tree's file content's
            (format 2).
        checksum: ``"xxh3-128:<hex>"`` over the payload (format 1) or the entries
            (format 2).
        payload: the payload's key under ``checkpoints/`` (format 1); ``None`` for a tree.
        attempt: the attempt that committed it.
        seq: its save number within that attempt.
        created: when it was committed: Unix time in seconds, from the writer's clock.
        format: the store format, 1 or 2.
        stats: what the save cost (seconds, bytes), when recorded.
        entries: a tree's paths, parents first (format 2); ``None`` for format 1.
        objects: a tree's content objects and their stored sizes in bytes (format 2).
        parts: for a tree several processes wrote, each writer's rank (as a string) and
            the paths it contributed; ``None`` when one process wrote it.
        step: the training step reported when the save was called, if any.
        preemption: whether it was saved after a preemption signal came.
    """

    kind: Kind
    name: str | None
    codec: Codec
    size: int
    checksum: str
    payload: str | None
    attempt: int
    seq: int
    created: float
    format: int = 1
    stats: dict[str, Any] | None = None
    entries: tuple[Entry, ...] | None = None
    objects: dict[str, int] | None = None
    parts: dict[str, tuple[str, ...]] | None = None
    step: int | None = None
    preemption: bool = False

    @property
    def is_tree(self) -> bool:
        """Whether this is a format-2 directory (entries and objects, no payload)."""
        return self.entries is not None

    @property
    def order(self) -> tuple[int, int]:
        """The sort key: later attempts first, then later saves within an attempt."""
        return (self.attempt, self.seq)

    @property
    def key(self) -> str:
        """This manifest's object name."""
        return manifest_name(self.attempt, self.seq)

    def only_part(self, rank: int, *, url: str) -> Manifest:
        """This tree with only the paths writer ``rank`` contributed.

        The result keeps this manifest's key and checksum (it names the same commit) and
        is for restoring, never for writing.

        Raises:
            CheckpointCoordinationError: the checkpoint has no part ``rank`` (it was written
                by one process, or by fewer ranks).
        """
        paths = (self.parts or {}).get(str(rank))
        if self.entries is None or paths is None:
            held = sorted(int(r) for r in self.parts or {})
            raise CheckpointCoordinationError(
                f"checkpoint {url} has no part of rank {rank!r}: "
                + (f"it holds the parts of ranks {held}" if held else "one process wrote it")
                + "; load it whole (part=None)",
                ranks=[rank] if isinstance(rank, int) else [],
            )
        wanted = set(paths)
        entries = tuple(e for e in self.entries if e.path in wanted)
        used = {b.object for e in entries for b in e.blobs}
        return replace(
            self, size=sum(e.size for e in entries if e.type == "file"), entries=entries,
            objects={k: v for k, v in (self.objects or {}).items() if k in used},
            parts={str(rank): paths},
        )

    def only_paths(self, paths: Collection[str], *, url: str) -> Manifest:
        """This tree with only ``paths`` (see :func:`check_paths`) and what they need.

        A file, symbolic or hard link path is kept alone; a directory path keeps
        everything under it. Kept too: the directories containing a kept path, and the
        file each kept hard link shares (wherever it lies). A symbolic link's target is
        not: a link is kept as a link. Like :meth:`only_part`, the result keeps this
        manifest's key and checksum and is for restoring, never for writing.

        Raises:
            CheckpointCoordinationError: the checkpoint is not a format-2 tree, or it holds
                none of some of ``paths`` (the message names them): nothing is restored,
                and no older checkpoint is taken instead.
        """
        if self.entries is None:
            raise CheckpointCoordinationError(
                f"checkpoint {url} is a {self.kind} checkpoint of store format {self.format}: "
                "only format-2 directory trees restore single paths; load it whole "
                "(paths=None)"
            )
        by_path = {e.path: e for e in self.entries}
        missing = sorted(p for p in paths if p not in by_path)
        if missing:
            shown = ", ".join(repr(p) for p in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise CheckpointCoordinationError(
                f"checkpoint {url} holds no {shown}{more} (it has {len(by_path)} paths): "
                "nothing was restored. Ask for paths of the newest checkpoint, or load it "
                "whole (paths=None)"
            )
        wanted = set(paths)
        dirs = tuple(f"{p}/" for p in wanted if by_path[p].type == "dir")
        if dirs:
            wanted.update(p for p in by_path if p.startswith(dirs))
        wanted.update(
            e.target for p in list(wanted)
            if (e := by_path[p]).type == "hardlink" and e.target is not None
        )
        for path in list(wanted):
            parent = path.rpartition("/")[0]
            while parent and parent not in wanted:
                wanted.add(parent)
                parent = parent.rpartition("/")[0]
        entries = tuple(e for e in self.entries if e.path in wanted)
        used = {b.object for e in entries for b in e.blobs}
        parts = None
        if self.parts is not None:
            parts = {
                rank: kept for rank, held in self.parts.items()
                if (kept := tuple(p for p in held if p in wanted))
            }
        return replace(
            self, size=sum(e.size for e in entries if e.type == "file"), entries=entries,
            objects={k: v for k, v in (self.objects or {}).items() if k in used},
            parts=parts,
        )

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON."""
        record = asdict(self)
        if self.parts is None:
            del record["parts"]
        if self.stats is None:
            del record["stats"]
        if self.step is None:
            del record["step"]
        if not self.preemption:
            del record["preemption"]
        if self.entries is None:
            del record["entries"], record["objects"]
        else:
            del record["payload"], record["codec"]
            record["entries"] = [e.to_record() for e in self.entries]
            return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        return json.dumps(record, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, url: str, name: str | None = None) -> Manifest:
        """Parse and validate a manifest read from ``url``.

        Args:
            data: the manifest's bytes.
            url: where it was read, for messages.
            name: the object name it was read under; a manifest whose ``attempt`` and
                ``seq`` are another save's is corrupt (retention orders and keeps
                checkpoints by name, so it could not keep such a one's payload).

        Raises:
            CheckpointFormatError: the manifest comes from a newer format.
            CheckpointCorruptError: it is not a valid manifest of any known format.
        """
        with paused():  # a tree's manifest is millions of objects: see taskpoint.format._gc
            try:
                raw = loads_record(data)
            except ValueError as exc:
                raise CheckpointCorruptError(
                    f"manifest {url} is not valid JSON: {exc}", url=url
                ) from exc
            if not isinstance(raw, dict):
                raise CheckpointCorruptError(f"manifest {url} is not a JSON object", url=url)
            check_format(raw, url=url)
            manifest = cls._validated(raw, url)
        if name is not None and parse_manifest_name(name) != manifest.order:
            raise CheckpointCorruptError(
                f"manifest {url} records attempt {manifest.attempt}, save {manifest.seq}: "
                "another save's name",
                url=url,
            )
        return manifest

    @classmethod
    def _validated(cls, raw: dict[str, Any], url: str) -> Manifest:
        def bad(field: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(
                f"manifest {url} has an invalid {field!r}: {raw.get(field)!r}", url=url
            )

        fmt = raw.get("format")
        if fmt not in (1, TREE_FORMAT) or isinstance(fmt, bool):
            raise bad("format")
        if raw.get("kind") not in KINDS:
            raise bad("kind")
        tree = fmt == TREE_FORMAT and raw["kind"] == "directory"
        if tree:
            raw = {**raw, "codec": "none", "payload": None}
        elif raw.get("codec") not in CODECS:
            raise bad("codec")
        name = raw.get("name")
        if name is not None and (
            not isinstance(name, str) or "/" in name or "\x00" in name or name in ("", ".", "..")
            or _too_long(name)
        ):  # no file system names a file so: never from a save
            raise bad("name")
        if raw["kind"] != "bytes" and name is None:
            raise bad("name")
        for field in ("size", "attempt", "seq"):
            value = raw.get(field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(field)
        checksum = raw.get("checksum")
        if not isinstance(checksum, str) or not _CHECKSUM_RE.fullmatch(checksum):
            raise bad("checksum")
        payload = raw.get("payload")
        if not tree and (
            not isinstance(payload, str) or "/" in payload
            # A payload is its own save's: retention keeps payloads by the save their name
            # records, so one borrowed from an older save could be deleted under it.
            or parse_payload_name(payload) != (raw["attempt"], raw["seq"])
        ):
            raise bad("payload")
        entries: tuple[Entry, ...] | None = None
        objects: dict[str, int] | None = None
        parts: dict[str, tuple[str, ...]] | None = None
        if tree:
            objects = _objects(raw.get("objects"), bad)
            entries = _entries(raw.get("entries"), objects, bad)
            if sum(e.size for e in entries if e.type == "file") != raw["size"]:
                raise bad("size")
            if checksum != tree_checksum(entries):
                raise bad("checksum")
            parts = _parts(raw.get("parts"), entries, bad)
        created = raw.get("created")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise bad("created")
        stats = raw.get("stats")
        if stats is not None and not isinstance(stats, dict):
            raise bad("stats")
        step = raw.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise bad("step")
        preemption = raw.get("preemption", False)
        if not isinstance(preemption, bool):
            raise bad("preemption")
        return cls(
            kind=raw["kind"],
            name=name,
            codec=raw["codec"],
            size=raw["size"],
            checksum=checksum,
            payload=payload,
            attempt=raw["attempt"],
            seq=raw["seq"],
            created=float(created),
            format=fmt,
            stats=stats,
            entries=entries,
            objects=objects,
            parts=parts,
            step=step,
            preemption=preemption,
        )


@dataclass(frozen=True)
class Blob:
    """A piece of a file's content: ``length`` bytes at ``offset`` of ``objects/<object>``,
    decoded with ``codec``, are ``size`` bytes hashing (XXH3-128, hex) to ``hash``."""

    object: str
    offset: int
    length: int
    codec: Codec
    size: int
    hash: str

    def to_record(self) -> list[Any]:
        return [self.object, self.offset, self.length, self.codec, self.size, self.hash]


@dataclass(frozen=True)
class Entry:
    """One path of a format-2 tree. ``target`` is a link's text (``symlink``) or the path
    of the file it shares (``hardlink``); ``blobs`` are a file's content in order."""

    path: str
    type: str
    mode: int = 0
    mtime_ns: int = 0
    size: int = 0
    hash: str | None = None
    blobs: tuple[Blob, ...] = ()
    target: str | None = None

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"path": self.path, "type": self.type}
        if self.type in ("file", "dir"):
            record.update(mode=self.mode, mtime_ns=self.mtime_ns)
        if self.type == "file":
            record.update(size=self.size, hash=self.hash, blobs=[b.to_record() for b in self.blobs])
        if self.target is not None:
            record["target"] = self.target
        return record


def tree_checksum(entries: tuple[Entry, ...]) -> str:
    """The checksum a format-2 manifest records: XXH3-128 over its entries' canonical JSON."""
    import xxhash

    text = json.dumps([e.to_record() for e in entries], sort_keys=True, separators=(",", ":"))
    return f"xxh3-128:{xxhash.xxh3_128_hexdigest(text.encode())}"


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _objects(raw: object, bad: Any) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise bad("objects")
    for name, size in raw.items():
        if not isinstance(name, str) or not _HEX_RE.fullmatch(name) or not _count(size):
            raise bad("objects")
    return dict(raw)


MAX_EXPANSION: dict[str, int] = {"none": 1, "gzip": 1032, "zstd": 32768}
"""The most content one stored byte of a blob can decode to, by codec. Deflate (in gzip)
writes at most 258 bytes per two bits; a zstd block of 4 bytes (header and one byte to
repeat) regenerates at most 128 KiB. Stored as is (``none``), a blob's size is its length."""


def _blob(raw: object, objects: dict[str, int]) -> Blob | None:
    if not isinstance(raw, list) or len(raw) != 6:
        return None
    name, offset, length, codec, size, digest = raw
    if (
        not isinstance(name, str) or name not in objects or not _count(offset)
        or not _count(length) or codec not in BLOB_CODECS or not _count(size)
        or not isinstance(digest, str) or not _HEX_RE.fullmatch(digest)
        or offset + length > objects[name]
        or (size != length if codec == "none" else size > length * MAX_EXPANSION[codec])
    ):
        return None
    return Blob(name, offset, length, codec, size, digest)


def _parts(
    raw: object, entries: tuple[Entry, ...], bad: Any
) -> dict[str, tuple[str, ...]] | None:
    """A tree's ``parts``: rank numbers to paths, every path an entry and every entry in one."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw:
        raise bad("parts")
    known = {e.path for e in entries}
    covered: set[str] = set()
    parts: dict[str, tuple[str, ...]] = {}
    for rank, paths in raw.items():
        if not isinstance(rank, str) or not rank.isdigit() or str(int(rank)) != rank:
            raise bad("parts")
        if not isinstance(paths, list) or not all(isinstance(p, str) and p in known for p in paths):
            raise bad("parts")
        parts[rank] = tuple(paths)
        covered.update(paths)
    if covered != known:
        raise bad("parts")
    return parts


def parse_entries(raw: object, objects: dict[str, int], *, url: str) -> tuple[Entry, ...]:
    """Entries from their records (:meth:`Entry.to_record`), checked as a manifest's are.

    Raises:
        CheckpointCorruptError: a record is malformed or uses an object not in ``objects``.
    """
    def bad(field: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{url} sent invalid {field!r}", url=url)

    return _entries(raw, _objects(objects, bad), bad)


NAME_MAX = 255
"""Bytes in one path component: no Linux or macOS file system takes a longer name, so no
save wrote one, and a manifest holding one is damaged (a load falls back past it)."""


PATH_MAX = 4096
"""Bytes a path may not reach (Linux's ``PATH_MAX``, its terminating NUL included): a save
walks the tree by full paths, ``root/path``, so no path it stored, nor any link it read, is
this long, and a manifest holding one is damaged. Fixed rather than this machine's
``os.pathconf``: it bounds what any saver's disk took (macOS takes 1024); a shorter path
that this disk refuses, under this restore folder, is the local disk's refusal."""


def _too_long(component: str) -> bool:
    return len(component.encode("utf-8", "surrogatepass")) > NAME_MAX


def _path_too_long(path: str) -> bool:
    return len(path.encode("utf-8", "surrogatepass")) >= PATH_MAX


def _unsaveable(path: str) -> bool:
    """Whether no save could have stored ``path``: it, or one of its components, too long."""
    if len(path) * 4 <= NAME_MAX:  # four bytes at most a character in UTF-8
        return False
    encoded = path.encode("utf-8", "surrogatepass")
    return len(encoded) >= PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/"))


def _entries(raw: object, objects: dict[str, int], bad: Any) -> tuple[Entry, ...]:
    """Entries with well-typed fields; path safety is the restorer's (archive.Extractor)."""
    if not isinstance(raw, list):
        raise bad("entries")
    result = []
    for item in raw:
        if not isinstance(item, dict) or item.get("type") not in ENTRY_TYPES:
            raise bad("entries")
        path, kind = item.get("path"), item["type"]
        if not isinstance(path, str) or not path or _unsaveable(path):
            raise bad("entries")
        if kind in ("symlink", "hardlink"):
            target = item.get("target")
            if not isinstance(target, str) or _path_too_long(target):  # symlink(2) refuses it
                raise bad("entries")
            result.append(Entry(path=path, type=kind, target=target))
            continue
        mode, mtime = item.get("mode"), item.get("mtime_ns")
        if not isinstance(mode, int) or not _count(mode) or not isinstance(mtime, int):
            raise bad("entries")
        if kind == "dir":
            result.append(Entry(path=path, type=kind, mode=mode & 0o7777, mtime_ns=mtime))
            continue
        size, digest, blobs = item.get("size"), item.get("hash"), item.get("blobs")
        if not _count(size) or not isinstance(digest, str) or not _CHECKSUM_RE.fullmatch(digest):
            raise bad("entries")
        if not isinstance(blobs, list):
            raise bad("entries")
        parsed = []
        for record in blobs:
            blob = _blob(record, objects)
            if blob is None:
                raise bad("entries")
            parsed.append(blob)
        if sum(b.size for b in parsed) != size:
            raise bad("entries")
        entry = Entry(
            path=path, type=kind, mode=mode & 0o7777, mtime_ns=mtime, size=size, hash=digest,
            blobs=tuple(parsed),
        )
        result.append(entry)
    return tuple(result)

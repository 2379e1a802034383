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
      "payload": "000001-000000004-3f2a9c1d.payload",  # key relative to checkpoints/
      "attempt": 1, "seq": 4,         # which attempt committed it, and its save number
      "created": 1764412345.123,      # Unix time in seconds, from the writer's clock
      "stats": {"save_s": 0.8, "upload_s": 0.7, "uploaded": 1234, "reused": 0,
                "blocked_s": 0.1, "background": true}   # optional: what the save cost
    }

Readers ignore fields they do not know, so optional fields such as ``stats`` stay format 1.
Records are parsed by :func:`loads_record`, which bounds what a hostile store can make a
reader do: integers of at most 64 digits, no NaN or infinities, nesting below Python's
recursion limit; anything else reads as not valid JSON.

Manifests are named ``<attempt:06d>-<seq:09d>.manifest.json`` so that sorting names sorts
checkpoints from oldest to newest: by attempt, then by save order within the attempt.

The same format number versions the rest of an action's layout: attempt markers and the
status record carry ``"format"`` too (a record without one is format 1), and
:func:`check_format` refuses anything newer than :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from taskpoint.errors import CheckpointCorruptError, CheckpointFormatError

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "KINDS",
    "Manifest",
    "check_format",
    "loads_record",
    "manifest_name",
    "parse_manifest_name",
    "parse_payload_name",
    "payload_name",
]

FORMAT_VERSION = 1
"""The store format (manifests, attempt markers, status record) this version writes, and the
newest it reads."""

Kind = Literal["bytes", "file", "directory"]
Codec = Literal["gzip", "zstd", "none"]
KINDS: tuple[Kind, ...] = ("bytes", "file", "directory")
CODECS: tuple[Codec, ...] = ("gzip", "zstd", "none")

_SUFFIX = ".manifest.json"
_CHECKSUM_RE = re.compile(r"xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64}")
_NAME_RE = re.compile(r"^(\d{6,})-(\d{9,})\.manifest\.json$")
_PAYLOAD_RE = re.compile(r"^(\d{6,})-(\d{9,})-[^-/]+\.payload$")


_MAX_DIGITS = 64


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def loads_record(data: bytes) -> object:
    """Parse a JSON record read from a store that may be damaged or hostile.

    Raises:
        ValueError: ``data`` is not UTF-8 JSON, holds an integer of more than 64 digits,
            NaN or an infinity, or nests too deeply to parse.
    """
    try:
        return json.loads(data, parse_int=_parse_int, parse_constant=_refuse_constant)
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
    """One committed checkpoint. See the module docstring for the fields."""

    kind: Kind
    name: str | None
    codec: Codec
    size: int
    checksum: str
    payload: str
    attempt: int
    seq: int
    created: float
    format: int = FORMAT_VERSION
    stats: dict[str, Any] | None = None

    @property
    def order(self) -> tuple[int, int]:
        """The sort key: later attempts first, then later saves within an attempt."""
        return (self.attempt, self.seq)

    @property
    def key(self) -> str:
        """This manifest's object name."""
        return manifest_name(self.attempt, self.seq)

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON."""
        record = asdict(self)
        if self.stats is None:
            del record["stats"]
        return json.dumps(record, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, url: str) -> Manifest:
        """Parse and validate a manifest read from ``url``.

        Raises:
            CheckpointFormatError: the manifest comes from a newer format.
            CheckpointCorruptError: it is not a valid manifest of any known format.
        """
        try:
            raw = loads_record(data)
        except ValueError as exc:
            raise CheckpointCorruptError(f"manifest {url} is not valid JSON: {exc}", url=url) from exc
        if not isinstance(raw, dict):
            raise CheckpointCorruptError(f"manifest {url} is not a JSON object", url=url)
        check_format(raw, url=url)
        return cls._validated(raw, url)

    @classmethod
    def _validated(cls, raw: dict[str, Any], url: str) -> Manifest:
        def bad(field: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(
                f"manifest {url} has an invalid {field!r}: {raw.get(field)!r}", url=url
            )

        if raw.get("format") != FORMAT_VERSION:
            raise bad("format")
        if raw.get("kind") not in KINDS:
            raise bad("kind")
        if raw.get("codec") not in CODECS:
            raise bad("codec")
        name = raw.get("name")
        if name is not None and (not isinstance(name, str) or "/" in name or name in ("", ".", "..")):
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
        if not isinstance(payload, str) or "/" in payload or not payload.endswith(".payload"):
            raise bad("payload")
        created = raw.get("created")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise bad("created")
        stats = raw.get("stats")
        if stats is not None and not isinstance(stats, dict):
            raise bad("stats")
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
            stats=stats,
        )

"""Property-based hard edges (issue #17): whatever a store holds, loading stays honest.

Hypothesis generates what a damaged or hostile store can hold, and checks three properties:

- **A load is honest.** ``Checkpoint(url).load_sync()`` returns a path inside its restore
  folder, ``None`` when nothing was committed, or raises one of the errors the README
  documents (``CheckpointCorruptError``, ``CheckpointUnsafeError``,
  ``CheckpointFormatError``, ``CheckpointStoreError``, ``CheckpointRestoreError``);
  anything else (a ``KeyError``, a ``RecursionError``, a raw ``OSError``) fails the test.
- **A load writes nowhere else.** Every example runs in a sandbox folder holding the store,
  an ``outside`` folder that hostile paths aim at, and the restore folder six levels deep,
  so a climb out of it lands in the sandbox. Everything in the sandbox but the restore folder
  (the store included) is the same after the load, byte for byte; no restored link resolves
  outside the restore folder and no restored file shares an inode with one outside it.
- **Restoring into a folder gives exactly the checkpoint.** Whatever ``into`` held (files
  with the right or wrong content, folders where files go, links and hard links to the
  ``outside`` folder), a directory checkpoint restored into it is exactly the saved tree,
  and nothing outside it changes.
- **Retention keeps what a load returns.** After ``prune``, ``taskpoint gc`` or a save with
  ``keep=K``, the checkpoint a load returned before still loads (a save's own commit is the
  newer one), and the newest ``K`` intact checkpoints are all still intact.

What is generated:

- manifests: real format-1 (bytes, file, directory) and format-2 manifests written by
  ``save_sync``, then mutated: fields set to other JSON values (huge and negative integers,
  NaN, wrong types, nesting, hostile names and payload keys), dropped, format-2 entries
  rewritten (absolute, ``..``, NUL and 300-character paths, links leaving the tree,
  duplicates, hard links to outside, sizes that lie, missing objects) with the checksum
  recomputed as an attacker would, and raw bytes cut short, prefixed, nested 100,000 deep
  or given a 5,000-digit integer;
- tar archives (format 1) with hostile members: symlink chains (the CVE-2025-4517 one
  among them), hard links, devices, FIFOs, absolute and climbing names, long names, links
  out of the tree and entries under links, committed with a checksum that matches;
- litter in a restore folder: right and wrong files, folders, links in and out, hard links
  to files outside;
- store layouts: a run with intact checkpoints of every kind made by real saves across
  attempts, then payloads and objects corrupted or deleted, manifests garbled, truncated or
  deleted, garbage planted under far-future names, manifests copied under another name and
  stray payloads.

Reproducibility: the ``ci`` Hypothesis profile (root ``conftest.py``, the default) sets
``derandomize=True`` and no example database, so every run of this file tries the same
examples and CI cannot flake on a new random draw; ``HYPOTHESIS_PROFILE=explore`` draws
fresh examples (and keeps failures in ``.hypothesis/``) for a local hunt. Example counts
keep the file well under a minute on one slow core.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import xxhash
from click.testing import CliRunner
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from taskpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointRestoreError,
    CheckpointStoreError,
    CheckpointUnsafeError,
    TaskpointWarning,
)
from taskpoint.cli import main
from taskpoint.format._digest import Digest
from taskpoint.format.manifest import Manifest, manifest_name, parse_manifest_name, payload_name

DOCUMENTED = (
    CheckpointCorruptError,
    CheckpointUnsafeError,
    CheckpointFormatError,
    CheckpointStoreError,
    CheckpointRestoreError,
)
"""What a load may raise (README, "What it guarantees"); TaskAttemptError is a runner's."""

OUT = "{OUT}"
"""Stands for the sandbox's ``outside`` folder in generated absolute paths, so that an escape
lands where the test looks (and never in the real file system: the tests may run as root)."""

# -- the sandbox ------------------------------------------------------------------------------


@dataclass
class Sandbox:
    base: Path
    store: Path
    restore: Path
    outside: Path

    @property
    def url(self) -> str:
        return f"file://{self.store}"

    def fill(self, text: str) -> str:
        return text.replace(OUT, str(self.outside))


@contextlib.contextmanager
def _sandbox() -> Iterator[Sandbox]:
    with tempfile.TemporaryDirectory(prefix="taskpoint-prop-") as tmp:
        base = Path(tmp)
        outside = base / "outside"
        outside.mkdir()
        (outside / "keep").write_bytes(b"mine")
        restore = base.joinpath("w1", "w2", "w3", "w4", "w5", "restore")
        restore.mkdir(parents=True)
        store = base / "root" / "train.fit" / "run-1"
        store.mkdir(parents=True)
        yield Sandbox(base, store, restore, outside)


def _snapshot(base: Path, skip: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``base`` but ``skip``'s content: type, size, mtime, content or link."""
    found: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in dirnames + filenames:
            path = here / name
            st_ = path.lstat()
            if stat.S_ISREG(st_.st_mode):
                extra: Any = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st_.st_mode):
                extra = os.readlink(path)
            else:
                extra = None
            mtime = None if stat.S_ISDIR(st_.st_mode) and path == skip else st_.st_mtime_ns
            found[str(path.relative_to(base))] = (st_.st_mode, st_.st_size, mtime, extra)
    return found


def _inodes(base: Path, skip: Path) -> set[tuple[int, int]]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in filenames:
            st_ = (here / name).lstat()
            if stat.S_ISREG(st_.st_mode):
                found.add((st_.st_dev, st_.st_ino))
    return found


def _inside(path: str | Path, folder: Path) -> bool:
    return os.path.abspath(path).startswith(str(folder) + os.sep)


def _load(url: str, workdir: Path, into: Path | None = None) -> Path | CheckpointError | None:
    """Load, returning a documented error instead of raising it; anything else propagates."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TaskpointWarning)
        try:
            return Checkpoint(url, workdir=workdir).load_sync(into=into)
        except CheckpointError as exc:
            assert isinstance(exc, DOCUMENTED), f"undocumented error {type(exc).__name__}: {exc}"
            return exc


def _load_confined(box: Sandbox, *, into: bool = False) -> Path | CheckpointError | None:
    """Load from ``box``'s store and check that nothing outside the restore folder changed.

    With ``into``, the restore folder is the load's ``into`` and already holds what a
    previous attempt left: a file whose content a tree may reuse, and links to the
    ``outside`` folder, which the restore must remove or replace without following.
    """
    if into:
        (box.restore / "b").write_bytes(PLANTED)
        (box.restore / "sub").symlink_to(box.outside)
        (box.restore / "l").symlink_to(box.outside / "keep")
        (box.restore / "tree").symlink_to(box.outside)
        (box.restore / "d").mkdir()
        (box.restore / "d" / "a").write_bytes(PLANTED)
    before = _snapshot(box.base, box.restore)
    inner = _snapshot(box.restore, box.base / "none")
    outer = _inodes(box.base, box.restore)
    result = _load(box.url, box.restore, box.restore if into else None)
    note(f"load: {result!r}")
    event(f"load: {type(result).__name__}")
    assert _snapshot(box.base, box.restore) == before, "a load changed something outside"
    if isinstance(result, Path):
        assert _inside(result, box.restore) or (into and result == box.restore), result
    after = _snapshot(box.restore, box.base / "none")
    for dirpath, dirnames, filenames in os.walk(box.restore):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st_ = path.lstat()
            if inner.get(str(path.relative_to(box.restore))) == after.get(
                str(path.relative_to(box.restore))
            ):
                continue  # what into held before, untouched
            if stat.S_ISLNK(st_.st_mode):
                assert _inside(os.path.realpath(path), box.restore) or os.path.realpath(
                    path
                ) == str(box.restore), f"{path} -> {os.readlink(path)} leaves the restore folder"
            elif stat.S_ISREG(st_.st_mode):
                assert (st_.st_dev, st_.st_ino) not in outer, f"{path} is a file outside"
    if isinstance(result, CheckpointError):  # nothing left behind, nothing in into changed
        assert after == inner, "a failed load changed the restore folder"
    return result


# -- strategies: names and JSON ---------------------------------------------------------------

SEGMENTS = st.one_of(
    st.sampled_from(["a", "b", "c", "..", ".", "", "x" * 300, "n\x00ul", "sp ace", "é", "\\",
                     "c:", "~", "-", "a..b"]),
    st.text(alphabet="ab.\\- é", min_size=1, max_size=4),
)
HOSTILE_PATHS = st.one_of(
    st.lists(SEGMENTS, min_size=1, max_size=5).map("/".join),
    st.sampled_from([OUT, f"{OUT}/pwned", f"{OUT}/keep", "/", "//", "../" * 8 + "pwned",
                     "a/" * 40 + "deep", "./a", "a/./b", "a//b", "a/"]),
)
"""Relative, absolute (into the sandbox's ``outside``), climbing, NUL, long and odd paths."""

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(), st.text(max_size=12), HOSTILE_PATHS,
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
"""Any JSON value (NaN and infinities too, which json.dumps writes and taskpoint refuses)."""

FIELDS = ["format", "kind", "name", "codec", "size", "checksum", "payload", "attempt", "seq",
          "created", "stats", "entries", "objects", "extra"]
NEAR_VALID: dict[str, st.SearchStrategy[Any]] = {
    "format": st.sampled_from([0, 1, 2, 3, 99, -1, True, "1", 1.0, 2**63]),
    "kind": st.sampled_from(["bytes", "file", "directory", "dir", "", "symlink"]),
    "codec": st.sampled_from(["gzip", "zstd", "none", "bz2", ""]),
    "size": st.sampled_from([0, 1, -1, 2**31, 2**64, 10**60]),
    "payload": st.sampled_from(["../x.payload", "x/../../y.payload", "/abs.payload",
                                "000000-000000000-planted0.payload", ".payload", "a\x00.payload"]),
    "checksum": st.sampled_from(["xxh3-128:" + "0" * 32, "sha256:" + "0" * 64, "md5:00", ""]),
}


@st.composite
def field_values(draw: st.DrawFn, name: str) -> Any:
    if name == "name" or draw(st.booleans()):
        return draw(HOSTILE_PATHS if name == "name" else JSON_VALUES)
    return draw(NEAR_VALID.get(name, JSON_VALUES))


# -- strategies: format-2 entries --------------------------------------------------------------

ENTRY_KEYS = ["path", "type", "mode", "mtime_ns", "size", "hash", "blobs", "target"]
NAME_POOL = st.sampled_from(["a", "b", "sub", "sub/a", "sub/b", "l", "h", "a/b/c"])


@st.composite
def entry_records(draw: st.DrawFn) -> dict[str, Any]:
    """One format-2 entry, well-formed or not; ``{OBJ}`` stands for the planted object."""
    kind = draw(st.sampled_from(["file", "dir", "symlink", "hardlink"] * 4 + ["fifo", "device"]))
    record: dict[str, Any] = {"path": draw(NAME_POOL | HOSTILE_PATHS), "type": kind}
    if kind in ("file", "dir"):
        record["mode"] = draw(st.sampled_from([0o644, 0o755, 0o4755, 0o7777, 0o177777, 0]))
        record["mtime_ns"] = draw(st.sampled_from([0, 1_700_000_000 * 10**9, -1, 2**62]))
    if kind == "file":
        record["size"] = len(PLANTED)
        record["hash"] = "xxh3-128:" + PLANTED_HASH
        record["blobs"] = [["{OBJ}", 0, len(PLANTED), "none", len(PLANTED), PLANTED_HASH]]
        if draw(st.integers(0, 3)) == 0:  # a content record that lies
            size = draw(st.sampled_from([0, 5, 12, 2**40, 2**62]))
            record["size"] = size
            record["blobs"] = [[
                draw(st.sampled_from(["{OBJ}", "f" * 32])),
                draw(st.sampled_from([0, 3, 11])), draw(st.sampled_from([11, 5, 0, 2**40])),
                draw(st.sampled_from(["none", "gzip", "zstd"])), size,
                draw(st.sampled_from([PLANTED_HASH, "0" * 32])),
            ]]
    if kind in ("symlink", "hardlink"):
        record["target"] = draw(NAME_POOL | HOSTILE_PATHS)
    return record


PLANTED = b"hello world"
PLANTED_HASH = xxhash.xxh3_128_hexdigest(PLANTED)


def _seal(record: dict[str, Any]) -> None:
    """Recompute a format-2 manifest's size and checksum over its (edited) entries, as an
    attacker able to write the store would."""
    entries = record.get("entries")
    if not isinstance(entries, list):
        return
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    record["checksum"] = f"xxh3-128:{xxhash.xxh3_128_hexdigest(text.encode())}"
    sizes = [e.get("size") for e in entries if isinstance(e, dict) and e.get("type") == "file"]
    if all(isinstance(s, int) for s in sizes):
        record["size"] = sum(sizes)


# -- strategies: manifest mutations -------------------------------------------------------------


@dataclass
class Mutation:
    fields: list[tuple[str, str, Any]] = field(default_factory=list)  # ("set"/"del", key, value)
    entries: list[tuple[str, int, Any]] = field(default_factory=list)
    seal: bool = True
    raw: str | None = None
    cut: int = 0


@st.composite
def mutations(draw: st.DrawFn) -> Mutation:
    m = Mutation()
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(FIELDS))
        if draw(st.integers(0, 4)) == 0:
            m.fields.append(("del", key, None))
        else:
            m.fields.append(("set", key, draw(field_values(key))))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["add", "dup", "del", "set", "replace"]))
        index = draw(st.integers(0, 8))
        if op == "set":
            key = draw(st.sampled_from(ENTRY_KEYS))
            value: Any = (key, draw(HOSTILE_PATHS | JSON_VALUES))
        elif op in ("add", "replace"):
            value = draw(entry_records())
        else:
            value = None
        m.entries.append((op, index, value))
    m.seal = draw(st.integers(0, 4)) > 0
    m.raw = draw(st.sampled_from([None] * 6 + ["cut", "prefix", "nest", "digits", "empty",
                                                "array", "utf16"]))
    m.cut = draw(st.integers(0, 400))
    return m


def _mutate(data: bytes, m: Mutation, objects: dict[str, int], box: Sandbox) -> bytes:
    record = json.loads(data)
    for op, key, value in m.fields:
        if op == "del":
            record.pop(key, None)
        else:
            record[key] = copy.deepcopy(value)
    entries = record.get("entries")
    if isinstance(entries, list):
        for op, index, value in m.entries:
            at = index % (len(entries) + 1)
            if op == "add":
                entries.insert(at, copy.deepcopy(value))
            elif op == "dup" and entries:
                entries.insert(at, copy.deepcopy(entries[at % len(entries)]))
            elif op == "del" and entries:
                entries.pop(at % len(entries))
            elif op == "replace" and entries:
                entries[at % len(entries)] = copy.deepcopy(value)
            elif op == "set" and entries and isinstance(entries[at % len(entries)], dict):
                key, new = value
                entries[at % len(entries)][key] = copy.deepcopy(new)
        if isinstance(record.get("objects"), dict):
            record["objects"].update(objects)
    obj = next(iter(objects), "0" * 32)
    record = json.loads(box.fill(json.dumps(record).replace("{OBJ}", obj)))
    if m.seal and isinstance(record.get("entries"), list):
        _seal(record)
    out = json.dumps(record, sort_keys=True).encode()
    if m.raw == "cut":
        out = out[: m.cut]
    elif m.raw == "prefix":
        out = b"\xef\xbb\xbf" + out
    elif m.raw == "nest":
        out = b'{"format": 1, "kind": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif m.raw == "digits":
        out = out.replace(b'"seq": ', b'"seq": ' + b"9" * 5000 + b", \"x\": ", 1)
    elif m.raw == "empty":
        out = b""
    elif m.raw == "array":
        out = b"[" + out + b"]"
    elif m.raw == "utf16":
        out = out.decode().encode("utf-16")
    return out


# -- real checkpoints ----------------------------------------------------------------------------


def _tree(root: Path, salt: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a").write_bytes(f"a of {salt}".encode() * 20)
    (root / "b").write_bytes(f"b of {salt}".encode())
    os.symlink("sub/a", root / "l")
    os.link(root / "b", root / "h")
    (root / "empty").mkdir()
    return root


def _save(url: str, kind: str, salt: str, scratch: Path, *, attempt: int, keep: int = 100) -> Any:
    """Save a checkpoint of ``kind`` whose content depends on ``salt``; what a load returns."""
    fmt = 1 if kind != "dir2" else 2
    ckpt = Checkpoint(url, attempt=attempt, keep=keep, store_format=fmt)
    if kind == "bytes":
        data = f"bytes of {salt}".encode()
        ckpt.save_sync(data)
        return ("checkpoint.bin", data)
    src = scratch / f"src-{uuid.uuid4().hex[:8]}"
    if kind == "file":
        src.mkdir()
        path = src / "weights.pt"
        path.write_bytes(f"file of {salt}".encode() * 3)
        ckpt.save_sync(path)
        return ("weights.pt", path.read_bytes())
    tree = _tree(src / "state", salt)
    ckpt.save_sync(tree)
    return ("state", _read_tree(tree))


def _read_tree(root: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = path.read_bytes()
    return found


def _content(path: Path) -> Any:
    if path.is_dir():
        return (path.name, _read_tree(path))
    return (path.name, path.read_bytes())


def _fs(url: str) -> tuple[Any, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


# -- property 1: mutated manifests ----------------------------------------------------------------


@settings(max_examples=100)
@given(kind=st.sampled_from(["bytes", "file", "dir1", "dir2"]), m=mutations(),
       into=st.booleans())
def test_a_mutated_manifest_loads_falls_back_or_raises_a_documented_error(
    kind: str, m: Mutation, into: bool
) -> None:
    with _sandbox() as box:
        older = _save(box.url, "bytes", "older", box.base, attempt=0)
        newest = _save(box.url, kind, "newest", box.base, attempt=1)
        fs, path = _fs(box.url)
        obj_name = xxhash.xxh3_128_hexdigest(PLANTED)
        fs.makedirs(f"{path}/objects", exist_ok=True)
        fs.pipe_file(f"{path}/objects/{obj_name}", PLANTED)
        key = f"{path}/checkpoints/{manifest_name(1, 0)}"
        fs.pipe_file(key, _mutate(fs.cat_file(key), m, {obj_name: len(PLANTED)}, box))

        result = _load_confined(box, into=into)
        assert result is not None, "a committed, intact older checkpoint was there"
        if isinstance(result, Path) and result.is_file():  # the older one, or the same bytes
            assert result.read_bytes() in (older[1], newest[1])
        _ls_is_strict_json(str(box.base / "root"))


def _pull_is_confined(box: Sandbox) -> None:
    """``taskpoint pull`` exits 0 having made DEST, or 1 with a one-line error; it changes
    nothing else in the sandbox, and never raises (CliRunner keeps what was raised)."""
    before = _snapshot(box.base, box.restore)
    dest = box.restore / "pulled"
    with warnings.catch_warnings():  # skipped checkpoints warn (the suite makes that an error)
        warnings.simplefilter("ignore", TaskpointWarning)
        pulled = CliRunner().invoke(
            main, ["pull", "train.fit/run-1", str(dest), "--root", str(box.base / "root")]
        )
    assert pulled.exception is None or isinstance(pulled.exception, SystemExit), (
        pulled.output, pulled.exception)
    assert pulled.exit_code in (0, 1), pulled.output
    assert (pulled.exit_code == 0) == dest.exists(), pulled.output
    if pulled.exit_code:
        assert pulled.output.startswith("Error: ") and pulled.output.count("\n") == 1, pulled.output
    assert _snapshot(box.base, box.restore) == before, "a pull changed something outside DEST"


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} in the output")


def _ls_is_strict_json(root: str) -> None:
    """``taskpoint ls --json`` exits 0 and prints JSON that strict readers accept."""
    listed = CliRunner().invoke(main, ["ls", root, "--json"])
    assert listed.exit_code == 0, (listed.output, listed.exception)
    json.loads(listed.output, parse_constant=_refuse)


# -- property 2: hostile tree manifests (format 2) -------------------------------------------------


@settings(max_examples=100)
@given(entries=st.lists(entry_records(), min_size=1, max_size=6),
       seal=st.integers(0, 5).map(bool), lie_objects=st.integers(0, 5).map(lambda n: n == 0),
       into=st.booleans())
def test_a_hostile_tree_manifest_never_writes_outside(
    entries: list[dict[str, Any]], seal: bool, lie_objects: bool, into: bool
) -> None:
    with _sandbox() as box:
        fs, path = _fs(box.url)
        obj_name = xxhash.xxh3_128_hexdigest(PLANTED)
        fs.makedirs(f"{path}/objects", exist_ok=True)
        fs.pipe_file(f"{path}/objects/{obj_name}", PLANTED)
        text = json.dumps(entries).replace("{OBJ}", obj_name).replace(OUT, str(box.outside))
        record = {
            "format": 2, "kind": "directory", "name": "tree", "size": 0,
            "checksum": "xxh3-128:" + "0" * 32, "attempt": 0, "seq": 0, "created": 1.0,
            "objects": {obj_name: 3 if lie_objects else len(PLANTED)},
            "entries": json.loads(text),
        }
        if seal:
            _seal(record)
        fs.makedirs(f"{path}/checkpoints", exist_ok=True)
        fs.pipe_file(f"{path}/checkpoints/{manifest_name(0, 0)}", json.dumps(record).encode())

        result = _load_confined(box, into=into)
        assert result is not None
        # The sandbox's disk takes every path and size a save could store: a manifest
        # that asks for more is damaged, never the local disk's refusal.
        assert not isinstance(result, CheckpointRestoreError), result
        _pull_is_confined(box)


# -- property 3: hostile tar archives (format 1) ---------------------------------------------------

MEMBER_TYPES = [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE, tarfile.CONTTYPE]


@st.composite
def tar_members(draw: st.DrawFn) -> list[tuple[str, bytes, str, bytes]]:
    """``(name, type, linkname, data)`` of each member; links often aim at another member."""
    members: list[tuple[str, bytes, str, bytes]] = []
    if draw(st.integers(0, 5)) == 0:
        members += _cve_chain()
    for _ in range(draw(st.integers(1, 7))):
        names = [m[0] for m in members] or ["a"]
        name = draw(NAME_POOL | HOSTILE_PATHS | st.sampled_from(names).map(lambda n: n + "/x"))
        kind = draw(st.sampled_from(MEMBER_TYPES))
        link = ""
        if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
            link = draw(st.sampled_from(names) | NAME_POOL | HOSTILE_PATHS)
        data = draw(st.sampled_from([b"", b"pwned"])) if kind == tarfile.REGTYPE else b""
        members.append((name, kind, link, data))
    return members


def _cve_chain() -> list[tuple[str, bytes, str, bytes]]:
    """The CVE-2025-4517 gadget: links through long names past PATH_MAX, then out."""
    comp = "d" * 247
    steps = "abcdefghijklmnop"
    members = []
    path = ""
    for step in steps:
        members.append((os.path.join(path, comp), tarfile.DIRTYPE, "", b""))
        members.append((os.path.join(path, step), tarfile.SYMTYPE, comp, b""))
        path = os.path.join(path, comp)
    long_link = os.path.join(*steps, "l" * 254)
    members.append((long_link, tarfile.SYMTYPE, os.path.join(*[".."] * len(steps)), b""))
    members.append(("escape", tarfile.SYMTYPE, long_link + "/" + "../" * 2 + "outside", b""))
    members.append(("escape/pwned", tarfile.REGTYPE, "", b"pwned"))
    return members


def _archive(members: list[tuple[str, bytes, str, bytes]], box: Sandbox) -> bytes | None:
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, kind, link, data in members:
                info = tarfile.TarInfo(box.fill(name))
                info.type = kind
                info.linkname = box.fill(link)
                info.size = len(data)
                info.mode = 0o644
                if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
                    info.devmajor, info.devminor = 1, 3
                tar.addfile(info, io.BytesIO(data) if data else None)
    except (ValueError, tarfile.TarError, UnicodeError):
        return None  # tarfile cannot write it, so no store could hold it from tar either
    return buf.getvalue()


def _commit_payload(url: str, payload: bytes, *, codec: str, attempt: int = 0, seq: int = 0) -> None:
    digest = Digest()
    digest.update(payload)
    fs, path = _fs(url)
    token = payload_name(attempt, seq, "planted0")
    fs.makedirs(f"{path}/checkpoints", exist_ok=True)
    fs.pipe_file(f"{path}/checkpoints/{token}", payload)
    manifest = Manifest(
        kind="directory", name="tree", codec=codec, size=len(payload),  # type: ignore[arg-type]
        checksum=digest.checksum, payload=token, attempt=attempt, seq=seq, created=1.0,
    )
    fs.pipe_file(f"{path}/checkpoints/{manifest.key}", manifest.to_json())


@settings(max_examples=120)
@given(members=tar_members(), gz=st.booleans(), cut=st.integers(0, 3), into=st.booleans())
def test_a_hostile_archive_never_writes_outside(
    members: list[tuple[str, bytes, str, bytes]], gz: bool, cut: int, into: bool
) -> None:
    with _sandbox() as box:
        data = _archive(members, box)
        if data is None:
            return
        if cut:  # a truncated archive, committed with a checksum of what is there
            data = data[: len(data) * cut // 4]
        payload = gzip.compress(data, compresslevel=1) if gz else data
        _commit_payload(box.url, payload, codec="gzip" if gz else "none")

        result = _load_confined(box, into=into)
        assert result is not None
        assert not (box.outside / "pwned").exists()
        _pull_is_confined(box)


# -- property 4: restoring into a folder that holds anything -----------------------------------

INTO_PATHS = st.sampled_from(["sub", "sub/a", "b", "l", "h", "empty", "empty/x", "new",
                              "sub/a/deeper", "new/y", "state"])
INTO_KINDS = st.sampled_from(["right file", "wrong file", "dir", "link out", "link in",
                              "hard link out"])


def _litter(into: Path, litter: list[tuple[str, str]], tree: dict[str, Any], box: Sandbox) -> None:
    """Put what a previous attempt (or a user) may have left in ``into``."""
    for rel, kind in litter:
        path = into / rel
        parents = [into.joinpath(*Path(rel).parts[:i]) for i in range(1, len(Path(rel).parts))]
        if os.path.lexists(path) or any(p.is_symlink() or p.is_file() for p in parents):
            continue  # never write through what is there (a link to outside, say)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "right file":
                right = tree.get(rel)
                path.write_bytes(right if isinstance(right, bytes) else b"elsewhere")
            elif kind == "wrong file":
                path.write_bytes(b"wrong")
            elif kind == "dir":
                path.mkdir()
            elif kind == "link out":
                path.symlink_to(box.outside)
            elif kind == "link in":
                path.symlink_to("sub")
            else:
                os.link(box.outside / "keep", path)
        except OSError:
            continue  # something is there already, or a parent is a file or a link


@settings(max_examples=40)
@given(fmt=st.sampled_from([1, 2]), litter=st.lists(st.tuples(INTO_PATHS, INTO_KINDS),
                                                     max_size=6))
def test_restoring_into_a_littered_folder_gives_exactly_the_checkpoint(
    fmt: int, litter: list[tuple[str, str]]
) -> None:
    """A directory checkpoint's tree *becomes* ``into`` (README, ``load_sync``): whatever
    was there, links to elsewhere included, ends as exactly the saved tree, and nothing
    outside ``into`` changes."""
    with _sandbox() as box:
        _, tree = _save(box.url, "dir2" if fmt == 2 else "dir1", "into", box.base, attempt=0)
        _litter(box.restore, litter, tree, box)
        before = _snapshot(box.base, box.restore)
        result = _load(box.url, box.restore, box.restore)
        assert result == box.restore, result
        assert _read_tree(box.restore) == tree
        assert _snapshot(box.base, box.restore) == before
        assert (box.outside / "keep").read_bytes() == b"mine"


# -- property 5: store layouts and retention ---------------------------------------------------------

DAMAGES = ["corrupt", "delete", "garble_manifest", "truncate_manifest", "delete_manifest",
           "future_garbage", "copy_manifest", "stray_payload"]


@dataclass
class Record:
    """A manifest name in the store and what the test knows of it."""

    manifest_ok: bool
    needs: set[str]  # store keys its payload or objects live at
    content: Any
    broken: bool = False  # a payload or object it needs was corrupted or deleted


@dataclass
class Layout:
    saves: list[tuple[str, int, bool]]  # (kind, attempt bump, same content as others)
    damages: list[tuple[str, int]]
    retention: tuple[str, int]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    saves = draw(st.lists(st.tuples(st.sampled_from(["bytes", "file", "dir1", "dir2"]),
                                    st.integers(0, 2), st.booleans()), max_size=4))
    damages = draw(st.lists(st.tuples(st.sampled_from(DAMAGES), st.integers(0, 7)), max_size=4))
    retention = draw(st.tuples(st.sampled_from(["prune", "gc", "save", "collect"]),
                               st.integers(0, 3)))
    return Layout(saves, damages, retention)


def _needs(fs: Any, path: str, name: str) -> set[str]:
    record = json.loads(fs.cat_file(f"{path}/checkpoints/{name}"))
    if record.get("format") == 2 and record.get("kind") == "directory":
        return {f"objects/{o}" for o in record["objects"]}
    return {f"checkpoints/{record['payload']}"}


def _build(box: Sandbox, url: str, layout: Layout) -> dict[str, Record]:
    fs, path = _fs(url)
    fs.makedirs(f"{path}/checkpoints", exist_ok=True)
    records: dict[str, Record] = {}
    damaged: set[str] = set()
    attempt = 0
    for i, (kind, bump, shared) in enumerate(layout.saves):
        attempt += bump
        # Shared content: format-2 saves reference the objects an earlier one stored.
        content = _save(url, kind, "shared" if shared else f"save {i}", box.base, attempt=attempt)
        name = max(
            (n for n in (p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/checkpoints", detail=False))
             if parse_manifest_name(n) is not None),
            key=lambda n: parse_manifest_name(n) or (0, 0),
        )
        records[name] = Record(True, _needs(fs, path, name), content)
    names = sorted(records)
    for j, (damage, index) in enumerate(layout.damages):
        if damage == "future_garbage":
            name = manifest_name(999_999, j)
            fs.pipe_file(f"{path}/checkpoints/{name}", [b"not json", b"{}", b"[" * 50_000,
                                                         b'{"format": 1}'][index % 4])
            records[name] = Record(False, set(), None)
            continue
        if damage == "stray_payload":
            fs.pipe_file(f"{path}/checkpoints/{payload_name(index, 7, 'stray000')}", b"stray")
            continue
        if not names:
            continue
        name = names[index % len(names)]
        key = f"{path}/checkpoints/{name}"
        record = records[name]
        if damage in ("corrupt", "delete"):
            for need in sorted(record.needs)[:1]:
                if need in damaged:  # a second flip would undo the first
                    continue
                if damage == "delete":
                    fs.rm(f"{path}/{need}")
                else:
                    data = bytearray(fs.cat_file(f"{path}/{need}"))
                    data[len(data) // 2] ^= 0xFF
                    fs.pipe_file(f"{path}/{need}", bytes(data))
                damaged.add(need)
        elif not fs.exists(key):
            continue
        elif damage == "garble_manifest":
            fs.pipe_file(key, b"\x00garbled")
            record.manifest_ok = False
        elif damage == "truncate_manifest":
            fs.pipe_file(key, fs.cat_file(key)[:40])
            record.manifest_ok = False
        elif damage == "delete_manifest":
            fs.rm(key)
            del records[name]
            names.remove(name)
        elif damage == "copy_manifest":
            copy_name = manifest_name(900_000 + j, 0)
            fs.pipe_file(f"{path}/checkpoints/{copy_name}", fs.cat_file(key))
            # Another save's manifest under this name: corrupt, since retention keeps
            # checkpoints by name and could not keep this one's payload.
            records[copy_name] = Record(False, set(record.needs), record.content)
    for record in records.values():
        record.broken = bool(record.needs & damaged)
    return records


def _intact(record: Record) -> bool:
    return record.manifest_ok and not record.broken


def _order(name: str) -> tuple[int, int]:
    return parse_manifest_name(name) or (0, 0)


def _expected(records: dict[str, Record]) -> Any:
    """What a load must give: the newest intact checkpoint's content, None, or an error."""
    if not records:
        return None
    intact = [n for n in records if _intact(records[n])]
    if not intact:
        return CheckpointCorruptError
    return records[max(intact, key=_order)].content


def _check_load(url: str, workdir: Path, expected: Any) -> None:
    result = _load(url, workdir)
    if expected is CheckpointCorruptError:
        assert isinstance(result, CheckpointCorruptError), result
    elif expected is None:
        assert result is None
    else:
        assert isinstance(result, Path), result
        assert _content(result) == expected


@settings(max_examples=80)
@given(layout=layouts(), memory=st.booleans())
def test_retention_never_deletes_the_checkpoint_a_load_returns(
    layout: Layout, memory: bool
) -> None:
    with _sandbox() as box:
        root = f"memory://taskpoint-prop-{uuid.uuid4().hex}/root" if memory else str(
            box.base / "root")
        url = f"{root}/train.fit/run-1"
        try:
            records = _build(box, url, layout)
            expected = _expected(records)
            needs = [need for r in records.values() for need in r.needs]
            event("checkpoints share content" if len(set(needs)) < len(needs) else "no sharing")
            event(f"before retention: {getattr(expected, '__name__', type(expected).__name__)}")
            note(f"records: { {n: (_intact(r), sorted(r.needs)) for n, r in records.items()} }")
            _check_load(url, box.restore, expected)
            _ls_is_strict_json(root)

            fs, path = _fs(url)
            listed = set(fs.ls(f"{path}/checkpoints", detail=False))
            what, keep = layout.retention
            if what == "prune":
                Checkpoint(url).prune(max(keep, 1))
            elif what == "gc":
                result = CliRunner().invoke(main, ["gc", root, "--keep", str(keep)])
                assert result.exit_code == 0, result.output
            elif what == "collect":
                Checkpoint(url).collect()
            else:
                content = _save(url, "bytes", "after", box.base, attempt=1000, keep=max(keep, 1))
                expected = content

            _check_load(url, box.restore, expected)
            if expected is CheckpointCorruptError and what != "save":
                # Nothing is intact: retention has nothing it may count as kept.
                assert set(fs.ls(f"{path}/checkpoints", detail=False)) == listed
            if what != "collect":  # the newest K intact stay (a save's own commit is one)
                kept = max(keep, 1) - (what == "save")
                intact = sorted((n for n in records if _intact(records[n])), key=_order)
                for name in intact[len(intact) - kept:] if kept else ():
                    for key in (f"checkpoints/{name}", *records[name].needs):
                        assert fs.exists(f"{path}/{key}"), f"{key} of kept {name} was deleted"
        finally:
            if memory:
                fs_mem = fsspec.filesystem("memory")
                with contextlib.suppress(FileNotFoundError):
                    fs_mem.rm(root.split("/root")[0], recursive=True)


"""Hard edges: hostile and damaged stores, unlucky operators, racing writers.

Each test here failed before the behaviour it checks was built: a symlink chain that escapes
the restore folder, malformed manifests raising raw exceptions, retention trusting names
over manifests, local disk errors taken for corrupt checkpoints, two processes claiming the
same attempt, and blank roots taken as paths.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import _servers
import fsspec
import pytest
import taskpoint
from click.testing import CliRunner
from taskpoint import (
    Checkpoint,
    CheckpointRestoreError,
    CheckpointUnsafeError,
    TaskpointWarning,
)
from taskpoint.cli import main
from taskpoint.format._digest import Digest
from taskpoint.format.manifest import Manifest, manifest_name, payload_name
from taskpoint.store.store import Store

# -- helpers --------------------------------------------------------------------------------


def _plant(url: str, payload: bytes, *, attempt: int, seq: int, kind: str = "directory",
           name: str | None = "tree", codec: str = "none") -> str:
    """Commit ``payload`` under ``url`` as taskpoint would, with a checksum that matches."""
    digest = Digest()
    digest.update(payload)
    fs, path = fsspec.core.url_to_fs(url)
    token = payload_name(attempt, seq, "planted0")
    fs.makedirs(f"{path}/checkpoints", exist_ok=True)
    fs.pipe_file(f"{path}/checkpoints/{token}", payload)
    manifest = Manifest(
        kind=kind, name=name, codec=codec, size=len(payload),  # type: ignore[arg-type]
        checksum=digest.checksum, payload=token, attempt=attempt, seq=seq, created=time.time(),
    )
    fs.pipe_file(f"{path}/checkpoints/{manifest.key}", manifest.to_json())
    return manifest.key


def _tar(build: Callable[[tarfile.TarFile], None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        build(tar)
    return buf.getvalue()


def _entry(tar: tarfile.TarFile, name: str, kind: bytes, link: str = "",
           data: bytes | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time, links not followed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture
def accept_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's tar filters replaced by ones that accept every entry as it is."""
    def accept(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo:
        return member

    for name in ("data_filter", "tar_filter", "fully_trusted_filter"):
        monkeypatch.setattr(tarfile, name, accept, raising=False)


# -- 1. symlink chains and other archive tricks ----------------------------------------------


def _cve_2025_4517(tar: tarfile.TarFile) -> None:
    """Symlinks through nested long names whose resolved path outgrows PATH_MAX, which makes
    ``os.path.realpath`` (and the ``data`` filter built on it) stop checking, then a link
    and a file written through it, outside the tree."""
    comp = "d" * 247
    steps = "abcdefghijklmnop"
    path = ""
    for step in steps:
        _entry(tar, os.path.join(path, comp), tarfile.DIRTYPE)
        _entry(tar, os.path.join(path, step), tarfile.SYMTYPE, comp)
        path = os.path.join(path, comp)
    long_link = os.path.join(*steps, "l" * 254)
    _entry(tar, long_link, tarfile.SYMTYPE, os.path.join(*[".."] * len(steps)))
    _entry(tar, "escape", tarfile.SYMTYPE, long_link + "/" + "../" * 2 + "outside")
    _entry(tar, "escape/pwned", tarfile.REGTYPE, data=b"pwned")


ATTACKS: dict[str, Callable[[tarfile.TarFile], None]] = {
    "cve-2025-4517 chain": _cve_2025_4517,
    "file through a link": lambda tar: (
        _entry(tar, "up", tarfile.SYMTYPE, ".."),
        _entry(tar, "up/outside/pwned", tarfile.REGTYPE, data=b"pwned"),
    ),
    "link then a file of the same name": lambda tar: (
        _entry(tar, "f", tarfile.SYMTYPE, "../outside/pwned"),
        _entry(tar, "f", tarfile.REGTYPE, data=b"pwned"),
    ),
    "link resolved through a later link": lambda tar: (
        _entry(tar, "x", tarfile.DIRTYPE),
        _entry(tar, "a", tarfile.SYMTYPE, "b/outside"),
        _entry(tar, "b", tarfile.SYMTYPE, "x/../.."),
    ),
    "hard link to a link": lambda tar: (
        _entry(tar, "s", tarfile.SYMTYPE, "../outside/pwned"),
        _entry(tar, "h", tarfile.LNKTYPE, "s"),
    ),
    "link loop": lambda tar: (
        _entry(tar, "a", tarfile.SYMTYPE, "b"),
        _entry(tar, "b", tarfile.SYMTYPE, "a"),
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_archive_tricks_are_refused_whatever_the_tar_filter(
    attack: str, tmp_path: Path, accept_everything: None
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"mine")
    store = tmp_path / "store"
    _plant(str(store), _tar(ATTACKS[attack]), attempt=0, seq=0)
    before = _tree(tmp_path)

    with pytest.raises(CheckpointUnsafeError, match="refusing archive entry"):
        Checkpoint(store, workdir=tmp_path / "restore").load_sync()

    after = {k: v for k, v in _tree(tmp_path).items() if not k.startswith("restore")}
    assert after == before  # nothing written or changed outside the restore folder
    assert not (outside / "pwned").exists()
    restored = tmp_path / "restore"
    for path in restored.rglob("*") if restored.exists() else ():
        if path.is_symlink():  # no link that leaves the folder is left behind
            target = os.path.normpath(os.path.join(path.parent, os.readlink(path)))
            assert target.startswith(str(restored)), path


@pytest.mark.parametrize("into", [False, True])
def test_a_tree_entry_with_nul_in_its_path_is_refused(tmp_path: Path, into: bool) -> None:
    """Restoring into a folder looks for files to keep before the extractor checks names:
    a NUL in a path there once raised a bare ValueError."""
    import xxhash
    from taskpoint.format.manifest import Blob, Entry, tree_checksum

    store = tmp_path / "store"
    data = b"hello"
    digest = xxhash.xxh3_128_hexdigest(data)
    (store / "objects").mkdir(parents=True)
    (store / "objects" / digest).write_bytes(data)
    entries = tuple(
        Entry(path, "file", 0o644, 0, len(data), f"xxh3-128:{digest}",
              (Blob(digest, 0, len(data), "none", len(data), digest),))
        for path in ("a", "n\x00ul")
    )
    manifest = Manifest(
        kind="directory", name="tree", codec="none", size=2 * len(data),
        checksum=tree_checksum(entries), payload=None, attempt=0, seq=0, created=time.time(),
        format=2, entries=entries, objects={digest: len(data)},
    )
    (store / "checkpoints").mkdir()
    (store / "checkpoints" / manifest.key).write_bytes(manifest.to_json())
    restore = tmp_path / "restore"
    restore.mkdir()
    (restore / "a").write_bytes(data)  # a file a restore into the folder would keep

    with pytest.raises(CheckpointUnsafeError, match="NUL"):
        Checkpoint(store, workdir=tmp_path / "work").load_sync(into=restore if into else None)
    assert (restore / "a").read_bytes() == data


def test_links_inside_the_tree_still_round_trip(tmp_path: Path, accept_everything: None) -> None:
    """The checks refuse escapes only: chains of links that stay inside restore as saved."""
    tree = tmp_path / "tree"
    (tree / "deep" / "er").mkdir(parents=True)
    (tree / "deep" / "er" / "file").write_bytes(b"x" * 3000)
    os.symlink("deep/er", tree / "short")
    os.symlink("short/file", tree / "via-short")
    os.symlink("../../via-short", tree / "deep" / "er" / "back")
    os.link(tree / "deep" / "er" / "file", tree / "hard")
    ckpt = Checkpoint(tmp_path / "store", workdir=tmp_path / "restore")
    ckpt.save_sync(tree)
    restored = ckpt.load_sync()
    assert restored is not None
    assert (restored / "deep" / "er" / "back").read_bytes() == b"x" * 3000
    assert os.readlink(restored / "via-short") == "short/file"
    assert (restored / "hard").stat().st_ino == (restored / "deep" / "er" / "file").stat().st_ino


# -- 2. malformed manifests -------------------------------------------------------------------

GARBAGE_MANIFESTS = {
    "5000-digit integer": lambda good: good.replace(b'"size": ', b'"size": ' + b"9" * 5000 + b"0 * "),
    "deep nesting": lambda good: b"[" * 100_000 + b"]" * 100_000,
    "nested object": lambda good: b'{"format": 1, "kind": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    "NaN created": lambda good: good.replace(b'"created": ', b'"created": NaN, "x": '),
    "not UTF-8": lambda good: b"\xff\xfe" + good,
    "a number": lambda good: b"12",
    "stats not an object": lambda good: good[:-1] + b', "stats": [1]}',
    "float overflowing to infinity": lambda good: good.replace(
        b'"created": ', b'"created": 1e999, "x": '),
    "NUL in the name": lambda good: good.replace(b'"name": null', b'"name": "a\\u0000b"'),
}


@pytest.mark.parametrize("case", sorted(GARBAGE_MANIFESTS))
def test_malformed_newest_manifest_counts_as_corrupt_and_falls_back(
    case: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    store = root / "train.fit" / "run-1"
    Checkpoint(store, attempt=0, keep=2).save_sync(b"good")
    Checkpoint(store, attempt=5, keep=2).save_sync(b"newer")  # a manifest valid until garbled
    newer = store / "checkpoints" / manifest_name(5, 0)
    newer.write_bytes(GARBAGE_MANIFESTS[case](newer.read_bytes()))

    with pytest.warns(TaskpointWarning, match="skipping checkpoint"):
        restored = Checkpoint(store).load_sync()
    assert restored is not None and restored.read_bytes() == b"good"
    assert [m.key for m in Checkpoint(store).committed()] == [manifest_name(0, 0)]
    # `taskpoint ls` lists it as damaged and the good one as ok, and exits 0 (CliRunner
    # turns an uncaught exception into exit code 1 and keeps its traceback off the output,
    # so the exit code is what shows a crash here).
    listed = CliRunner().invoke(main, ["ls", str(root)])
    assert listed.exit_code == 0, (listed.output, listed.exception)
    assert f"checkpoints/{manifest_name(5, 0)} CORRUPT" in listed.output
    assert " ok" in listed.output and "Traceback" not in listed.output


def _reseal(record: dict[str, object]) -> None:
    """Make a format-2 manifest's size and checksum match its edited entries again, as an
    attacker able to write the store would."""
    import xxhash

    entries = record["entries"]
    assert isinstance(entries, list)
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    record["checksum"] = f"xxh3-128:{xxhash.xxh3_128_hexdigest(text.encode())}"
    record["size"] = sum(e["size"] for e in entries if e["type"] == "file")


@pytest.mark.parametrize(
    "where", ["file name", "tree path", "path over PATH_MAX", "link over PATH_MAX"]
)
def test_a_name_no_file_system_takes_counts_as_corrupt_and_falls_back(
    tmp_path: Path, where: str
) -> None:
    """A path component over 255 bytes, or a path or link text of 4096 bytes or more, could
    only come from a damaged or hostile store (a save walks full paths, which the kernel
    keeps below ``PATH_MAX``): the load skips that checkpoint for the previous one instead
    of blaming the local disk."""
    store = tmp_path / "store"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "w.bin").write_bytes(b"good")
    (tree / "sub" / "link").symlink_to("w.bin")
    (tmp_path / "w.bin").write_bytes(b"newer")
    Checkpoint(store, attempt=0, keep=2).save_sync(tree)
    Checkpoint(store, attempt=5, keep=2).save_sync(
        tmp_path / "w.bin" if where == "file name" else tree
    )
    newer = store / "checkpoints" / manifest_name(5, 0)
    record = json.loads(newer.read_bytes())
    long = "é" * 128  # 256 bytes in UTF-8
    deep = "/".join(f"{i:02d}" + "d" * 248 for i in range(20))  # 5019 bytes, 250 a component
    if where == "file name":
        record["name"] = long
    elif where == "link over PATH_MAX":
        (link,) = (e for e in record["entries"] if e["type"] == "symlink")
        link["target"] = "./" * 2048 + "w.bin"
        _reseal(record)
    else:  # renamed as an attacker would: the entries' checksum made to match
        for entry in record["entries"]:
            entry["path"] = entry["path"].replace(
                "sub", long if where == "tree path" else deep, 1
            )
        _reseal(record)
    newer.write_text(json.dumps(record))

    with pytest.warns(TaskpointWarning, match=f"skipping checkpoint .*{manifest_name(5, 0)}"):
        restored = Checkpoint(store, workdir=tmp_path / "work").load_sync()
    assert restored is not None and (restored / "sub" / "w.bin").read_bytes() == b"good"


@contextlib.contextmanager
def _files_capped(limit: int) -> Iterator[None]:
    """No file this process writes or truncates may grow past ``limit`` bytes (EFBIG)."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the default kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize(
    ("lie", "found"),
    [
        ("blob size", "invalid 'entries'"),  # 4 bytes stored as is, said to decode to 2**62
        ("gzip ratio", "invalid 'entries'"),  # 4 gzip bytes, past what deflate can expand
        ("object size", "damaged"),  # the object, the blob and the file all said 2**62
    ],
)
def test_sizes_no_object_backs_count_as_corrupt_and_fall_back(
    store_url: str, tmp_path: Path, lie: str, found: str
) -> None:
    """A tree manifest claiming more content than its objects can hold is damaged: the
    load falls back to the older checkpoint, naming the damaged manifest, and allocates
    nothing for the claim (files are capped at 64 KiB while it runs), instead of stopping
    with a local-disk error ("File too large") that blames the restore folder."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "w.bin").write_bytes(b"good")
    ckpt = Checkpoint(store_url, keep=2)
    ckpt.save_sync(tree)
    (tree / "w.bin").write_bytes(b"newr")
    ckpt.save_sync(tree)
    newest = ckpt.committed()[0]
    fs, path = fsspec.core.url_to_fs(store_url)
    key = f"{path}/checkpoints/{newest.key}"
    record = json.loads(fs.cat_file(key))
    (entry,) = (e for e in record["entries"] if e["type"] == "file")
    blob = entry["blobs"][0]
    assert blob[2:5] == [4, "none", 4]
    huge = 2**62
    if lie == "blob size":
        blob[4] = huge
    elif lie == "gzip ratio":
        blob[3], blob[4] = "gzip", 1032 * 4 + 1
    else:
        record["objects"][blob[0]] = huge
        blob[2] = blob[4] = huge - blob[1]
    entry["size"] = blob[4]
    _reseal(record)
    fs.pipe_file(key, json.dumps(record).encode())

    with _files_capped(64 * 1024), pytest.warns(
        TaskpointWarning, match=f"skipping checkpoint .*{newest.key}.*{found}"
    ):
        restored = Checkpoint(store_url, workdir=tmp_path / "work").load_sync()
    assert restored is not None and (restored / "w.bin").read_bytes() == b"good"


def test_garbage_records_never_break_history_or_claims(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "attempts").mkdir(parents=True)
    (store / "attempts" / "000000").write_bytes(b"[" * 100_000)
    (store / "attempts" / "000000.end.json").write_bytes(b'{"ended": 1' + b"0" * 5000 + b"}")
    (store / "status.json").write_bytes(b"[" * 100_000)
    ckpt = Checkpoint(store)
    assert ckpt.status() is None
    ckpt.save_sync(b"state")
    assert ckpt.attempt == 1
    records = taskpoint.format.history.read_attempts(Store(str(store)))
    assert [(r.attempt, r.ended) for r in records] == [(0, None), (1, None)]



def test_a_long_history_is_read_concurrently_and_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run restarted many times has four records per attempt: read one at a time, each
    cost a round trip (on S3, inside a save that picks its interval from the history)."""
    attempts = tmp_path / "store" / "attempts"
    attempts.mkdir(parents=True)
    for n in range(12):
        (attempts / f"{n:06d}").write_text(json.dumps({"format": 1, "started": 1000.0 + n}))
        (attempts / f"{n:06d}.end.json").write_text(
            json.dumps({"format": 1, "ended": 1000.5 + n, "outcome": "failed", "step": n})
        )
    (attempts / "000005.resume.json").mkdir()  # one unreadable record, named as such
    reading, peak, lock = 0, 0, threading.Lock()
    read_bytes = Store.read_bytes

    def slow_read(self: Store, name: str) -> bytes:
        nonlocal reading, peak
        with lock:
            reading += 1
            peak = max(peak, reading)
        try:
            time.sleep(0.02)  # an object store's round trip
            return read_bytes(self, name)
        finally:
            with lock:
                reading -= 1

    monkeypatch.setattr(Store, "read_bytes", slow_read)
    records = taskpoint.format.history.read_attempts(Store(str(tmp_path / "store")))
    assert [(r.attempt, r.started, r.ended, r.outcome, r.step) for r in records] == [
        (n, 1000.0 + n, 1000.5 + n, "failed", n) for n in range(12)
    ]
    assert [r.attempt for r in records if r.unreadable] == [5]
    assert records[5].unreadable[0][0] == "attempts/000005.resume.json"
    assert peak > 1


def test_the_history_reads_at_interpreter_exit_where_no_thread_can_start(tmp_path: Path) -> None:
    """At exit (an ``atexit`` hook, as the records of a life's end are written) no new
    thread may start; the records are then read on the exiting one."""
    store = tmp_path / "store"
    Checkpoint(store).save_sync(b"state")  # claims attempt 0
    code = textwrap.dedent(f"""
        import atexit, taskpoint
        def report():
            print("attempts at exit:", [r.attempt for r in taskpoint.Checkpoint({str(store)!r}).attempts()])
        atexit.register(report)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "attempts at exit: [0]" in run.stdout, run.stderr

# -- 3. retention keeps what a load would return ----------------------------------------------


def _corrupt_payload(store: Path, key: str) -> None:
    manifest = json.loads((store / "checkpoints" / key).read_text())
    payload = store / "checkpoints" / manifest["payload"]
    data = bytearray(payload.read_bytes())
    data[0] ^= 0xFF
    payload.write_bytes(bytes(data))


def test_gc_keeps_the_intact_checkpoint_an_unfinished_run_resumes_from(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = root / "train" / "run-1"
    ckpt = Checkpoint(store, attempt=0, keep=5)
    for step in range(3):
        ckpt.save_sync(f"step {step}".encode())
    _corrupt_payload(store, manifest_name(0, 2))

    result = CliRunner().invoke(main, ["gc", str(root), "--keep", "1"])
    assert result.exit_code == 0, result.output

    with pytest.warns(TaskpointWarning, match="skipping checkpoint"):
        restored = Checkpoint(store).load_sync()
    assert restored is not None and restored.read_bytes() == b"step 1"
    names = sorted(os.listdir(store / "checkpoints"))
    assert manifest_name(0, 0) not in names  # older than the one kept: pruned


@pytest.mark.parametrize("forgery", ["unparseable", "payload missing", "payload corrupt"])
def test_a_far_future_record_never_makes_saves_prune_good_checkpoints(
    forgery: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    Checkpoint(store, attempt=0).save_sync(b"last good")
    future = store / "checkpoints" / manifest_name(999_999, 0)
    if forgery == "unparseable":
        future.write_bytes(b"not json")
    else:
        _plant(str(store), b"forged", attempt=999_999, seq=0, kind="bytes", name=None)
        key = json.loads(future.read_text())["payload"]
        if forgery == "payload missing":
            (store / "checkpoints" / key).unlink()
        else:
            (store / "checkpoints" / key).write_bytes(b"FORGED")

    with pytest.warns(TaskpointWarning, match="skipping checkpoint"):
        assert Checkpoint(store).load_sync().read_bytes() == b"last good"  # type: ignore[union-attr]
    writer = Checkpoint(store, attempt=1)
    writer.save_sync(b"newer")  # keep=1: prunes, but never its own commit
    writer.save_sync(b"newest")
    with pytest.warns(TaskpointWarning, match="skipping checkpoint"):
        restored = Checkpoint(store).load_sync()
    assert restored is not None and restored.read_bytes() == b"newest"
    listing = os.listdir(store / "checkpoints")
    assert manifest_name(0, 0) not in listing and manifest_name(1, 0) not in listing


@pytest.mark.parametrize("forgery", ["copied under a newer name", "payload of an older save"])
def test_a_manifest_disagreeing_with_its_name_never_makes_prune_delete_what_loads(
    forgery: str, tmp_path: Path
) -> None:
    """Pruning keeps payloads by the save their name records; a manifest whose name, or whose
    payload's name, is another save's once won the load and then lost its payload to prune."""
    store = tmp_path / "root" / "train.fit" / "run-1"
    ckpt = Checkpoint(store, attempt=0, keep=10)
    ckpt.save_sync(b"first")
    ckpt.save_sync(b"second")
    first = (store / "checkpoints" / manifest_name(0, 0)).read_bytes()
    if forgery == "copied under a newer name":
        (store / "checkpoints" / manifest_name(7, 0)).write_bytes(first)
    else:
        record = json.loads(first)
        record.update(attempt=7, seq=0)
        (store / "checkpoints" / manifest_name(7, 0)).write_text(json.dumps(record))

    with pytest.warns(TaskpointWarning, match="skipping checkpoint"):
        assert Checkpoint(store).load_sync().read_bytes() == b"second"  # type: ignore[union-attr]
    Checkpoint(store).prune(1)
    with pytest.warns(TaskpointWarning, match="skipping checkpoint"):
        assert Checkpoint(store).load_sync().read_bytes() == b"second"  # type: ignore[union-attr]
    listing = CliRunner().invoke(main, ["ls", str(tmp_path / "root"), "--json"])
    assert listing.exit_code == 0, listing.output
    damaged = json.loads(listing.output)["actions"][0]["damaged"]
    assert [d["key"] for d in damaged] == [f"checkpoints/{manifest_name(7, 0)}"]


def test_fewer_intact_than_keep_deletes_nothing(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ckpt = Checkpoint(store, attempt=0, keep=10)
    for step in range(3):
        ckpt.save_sync(f"{step}".encode())
    _corrupt_payload(store, manifest_name(0, 2))
    before = sorted(os.listdir(store / "checkpoints"))
    assert Checkpoint(store).prune(3) == 0  # two intact ones only
    assert sorted(os.listdir(store / "checkpoints")) == before


def test_gc_reports_what_it_deleted_not_what_it_counted(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = root / "train.fit" / "run-1"
    ckpt = Checkpoint(store, attempt=0, keep=10)
    for step in range(4):
        ckpt.save_sync(f"{step}".encode())
    Checkpoint(store).mark_finished("succeeded", attempts=1)
    _corrupt_payload(store, manifest_name(0, 3))  # the newest intact one is now step 2
    listed = CliRunner().invoke(main, ["gc", str(root), "--keep", "1"])
    assert listed.exit_code == 0, listed.output
    # 3 of the 4 are beyond --keep 1 by count, but only the 2 older than step 2 can go
    assert "removed 2 checkpoint(s)" in listed.output, listed.output
    assert [m.key for m in Checkpoint(store).committed()] == [
        manifest_name(0, 3), manifest_name(0, 2)
    ]


# -- 5. local disk errors during a restore ----------------------------------------------------


def _store_listing(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in store.rglob("*"))


def test_restore_into_an_unusable_folder_stops_the_load(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ckpt = Checkpoint(store, attempt=0, keep=2)
    ckpt.save_sync(b"older")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "weights").write_bytes(b"w" * 1000)
    ckpt.save_sync(tree)
    before = _store_listing(store)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the restore folder should go")

    with pytest.raises(CheckpointRestoreError, match="local disk") as caught:
        Checkpoint(store, workdir=blocker / "restore").load_sync()
    assert str(blocker) in caught.value.path
    assert _store_listing(store) == before  # nothing marked bad, nothing pruned
    restored = Checkpoint(store, workdir=tmp_path / "ok").load_sync()
    assert restored is not None and (restored / "weights").read_bytes() == b"w" * 1000


def test_a_retry_restoring_into_the_same_workdir_loads_again(tmp_path: Path) -> None:
    """A fixed ``workdir=`` outlives an attempt: the next process restoring the same
    checkpoint there once met the first one's folder and failed with "File exists"."""
    store = tmp_path / "store"
    Checkpoint(store, attempt=0).save_sync(b"state")
    first = Checkpoint(store, workdir=tmp_path / "restore").load_sync()
    second = Checkpoint(store, workdir=tmp_path / "restore").load_sync()  # the retry
    assert first is not None and second is not None and first != second
    assert first.read_bytes() == second.read_bytes() == b"state"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real disk that fills up."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        _servers.required(f"cannot mount a tmpfs here: {done.stderr.strip()}",
                          "the disk-full restore test must run (CI runs as root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_full_disk_stops_the_load_and_keeps_every_checkpoint(
    kind: str, tmp_path: Path, small_disk: Path
) -> None:
    store = tmp_path / "store"
    ckpt = Checkpoint(store, attempt=0, keep=2)
    ckpt.save_sync(b"small and older")
    big = tmp_path / "big"
    if kind == "file":
        big.write_bytes(os.urandom(3 * 2**20))
    else:
        big.mkdir()
        (big / "shard").write_bytes(os.urandom(3 * 2**20))
    ckpt.save_sync(big)
    before = _store_listing(store)

    with pytest.raises(CheckpointRestoreError, match="No space left on device"):
        Checkpoint(store, workdir=small_disk).load_sync()
    assert _store_listing(store) == before
    assert list(small_disk.iterdir()) == []  # the partial restore is cleaned up
    # The next attempt, with room, resumes from the newest, and its save prunes nothing good.
    resumed = Checkpoint(store, attempt=1, keep=2, workdir=tmp_path / "roomy")
    assert resumed.load_sync() is not None
    resumed.save_sync(b"after")
    assert len(Checkpoint(store).committed()) == 2


def test_a_file_over_the_size_limit_stops_the_load(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ckpt = Checkpoint(store, attempt=0, keep=2)
    ckpt.save_sync(b"older")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "shard").write_bytes(os.urandom(2 * 2**20))
    ckpt.save_sync(tree)
    before = _store_listing(store)
    script = textwrap.dedent(f"""
        import resource, signal, sys
        import taskpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
        try:
            taskpoint.Checkpoint({str(store)!r}, workdir={str(tmp_path / 'restore')!r}).load_sync()
        except taskpoint.CheckpointRestoreError as exc:
            print("restore error:", exc)
            sys.exit(3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "File too large" in done.stdout
    assert _store_listing(store) == before


def test_a_write_the_disk_takes_in_part_is_continued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At a file size limit or a full disk, the first write past it returns a short count and
    # only the next one fails: a restore must continue, never leave the file short and succeed.
    tree = tmp_path / "tree"
    tree.mkdir()
    data = os.urandom(12 * 2**20)  # several blobs: all but the first are written in place
    (tree / "shard").write_bytes(data)
    ckpt = Checkpoint(tmp_path / "store")
    ckpt.save_sync(tree)
    real = os.pwrite
    calls = []

    def short(fd: int, buf: bytes | memoryview, offset: int) -> int:
        calls.append(len(buf))
        return real(fd, memoryview(buf)[: 4096], offset)

    monkeypatch.setattr(os, "pwrite", short)
    restored = Checkpoint(tmp_path / "store", workdir=tmp_path / "restore").load_sync()
    assert calls, "the restore wrote no piece of a file in place"
    assert restored is not None and (restored / "shard").read_bytes() == data


# -- 6. attempt claims are atomic on every store ----------------------------------------------


def test_exclusive_create_has_one_winner(store_url: str) -> None:
    store = Store(store_url)
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def create(i: int) -> None:
        barrier.wait()
        results.append(Store(store_url).create_exclusive("attempts/000000", f"{i}".encode()))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 5 + [True]
    assert store.create_exclusive("attempts/000000", b"again") is False
    assert store.read_bytes("attempts/000000") in {f"{i}".encode() for i in range(6)}


def test_concurrent_binds_never_share_an_attempt(store_url: str) -> None:
    attempts: list[int | None] = []
    barrier = threading.Barrier(5)

    def bind_and_save() -> None:
        ckpt = Checkpoint.at(store_url, keep=10)
        barrier.wait()
        ckpt.save_sync(b"state")
        attempts.append(ckpt.attempt)

    threads = [threading.Thread(target=bind_and_save) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(a for a in attempts if a is not None) == [0, 1, 2, 3, 4]


def test_processes_binding_at_once_never_share_an_attempt(tmp_path: Path) -> None:
    store = tmp_path / "store"
    go = tmp_path / "go"
    script = textwrap.dedent(f"""
        import os, time, taskpoint
        ckpt = taskpoint.Checkpoint.at({str(store)!r}, keep=10)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        ckpt.save_sync(b"x")
        print(ckpt.attempt)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    time.sleep(1.5)  # every process is waiting at the line
    go.touch()
    claimed = sorted(int(p.communicate(timeout=60)[0]) for p in procs)
    assert claimed == list(range(6))


# -- 8. blank roots ---------------------------------------------------------------------------


@pytest.mark.parametrize("blank", ["", "   ", "\t\n"])
def test_blank_roots_are_refused(blank: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="blank"):
        Checkpoint(blank)
    with pytest.raises(ValueError, match="root is blank"):
        taskpoint.TaskEnvironment(name="env", root=blank)
    monkeypatch.setenv("TASKPOINT_ROOT", blank)
    monkeypatch.setenv("TASKPOINT_ACTION", "job")
    with pytest.raises(ValueError, match="TASKPOINT_ROOT is blank"):
        taskpoint.ctx()
    env = taskpoint.TaskEnvironment(name="env")
    with pytest.raises(ValueError, match="TASKPOINT_ROOT is blank"):
        env.resolve_root()
    result = CliRunner().invoke(main, ["ls"])
    assert result.exit_code != 0 and "TASKPOINT_ROOT is blank" in result.output


@pytest.mark.parametrize("name", ["run-a\n", "run\n\n", "a/b", "..", ""])
def test_names_must_match_whole(name: str) -> None:
    """A trailing newline passed a ``$``-anchored check; names are matched whole."""
    with pytest.raises(ValueError, match="run_id must be"):
        taskpoint.TaskEnvironment(name="env", run_id=name)

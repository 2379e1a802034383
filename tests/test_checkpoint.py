"""Checkpoint save/load: kinds, integrity, lineage, retention and bad input."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

import fsspec
import pytest
import taskpoint
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointStoreError, TaskpointWarning

ONE_OBJECT_STORE = pytest.mark.stores("file", "s3")
"""For what is decided before the store is reached (argument checks) or is the same bytes on
every store (a codec): the file store and one object store are enough."""


def _fs_path(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def _objects(url: str) -> list[str]:
    fs, path = _fs_path(url)
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/checkpoints", detail=False))
    except FileNotFoundError:
        return []


def _make_tree(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "weights.bin").write_bytes(os.urandom(4096))
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "sub" / "deeper" / "notes.txt").write_text("hello")
    (root / "empty").mkdir()
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o750)
    (root / "private.key").write_text("k")
    (root / "private.key").chmod(0o600)
    (root / "last.ckpt").symlink_to("sub/deeper/notes.txt")
    os.utime(root / "weights.bin", ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    return root


def _tree_snapshot(root: Path) -> dict[str, tuple[str, object, int, int | None]]:
    snap: dict[str, tuple[str, object, int, int | None]] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        if path.is_symlink():
            snap[rel] = ("link", os.readlink(path), 0, None)
        elif path.is_dir():
            snap[rel] = ("dir", None, st.st_mode & 0o777, None)
        else:
            snap[rel] = ("file", path.read_bytes(), st.st_mode & 0o777, st.st_mtime_ns)
    return snap


def _assert_same_tree(restored: Path, original: Path) -> None:
    """Same entries, contents, modes and links; mtimes equal to tar's ~1 µs precision."""
    got, want = _tree_snapshot(restored), _tree_snapshot(original)
    assert sorted(got) == sorted(want)
    for rel, (kind, content, mode, mtime) in want.items():
        g_kind, g_content, g_mode, g_mtime = got[rel]
        assert (g_kind, g_content, g_mode) == (kind, content, mode), rel
        if mtime is not None:
            assert g_mtime is not None and abs(g_mtime - mtime) < 2_000, rel


def test_bytes_round_trip(store_url: str) -> None:
    ckpt = Checkpoint(store_url)
    assert ckpt.load_sync() is None
    ckpt.save_sync(b"step=3")
    restored = ckpt.load_sync()
    assert restored is not None and restored.read_bytes() == b"step=3"
    assert restored.name == "checkpoint.bin"


@pytest.mark.parametrize("data", [b"", bytearray(b"ab"), memoryview(b"cd")])
def test_bytes_like_round_trip_including_empty(store_url: str, data: bytes) -> None:
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(data)
    restored = ckpt.load_sync()
    assert restored is not None, "an empty payload is a checkpoint, not 'no checkpoint'"
    assert restored.read_bytes() == bytes(data)


def test_file_keeps_its_name_and_archives_are_not_extracted(store_url: str, tmp_path: Path) -> None:
    archive = tmp_path / "model.tar.gz"
    subprocess.run(["tar", "czf", str(archive), "-C", str(tmp_path), "."], check=False)
    payload = archive.read_bytes()
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(archive)
    restored = ckpt.load_sync()
    assert restored is not None
    assert restored.name == "model.tar.gz"
    assert restored.is_file() and restored.read_bytes() == payload


@ONE_OBJECT_STORE
def test_str_path_is_accepted(store_url: str, tmp_path: Path) -> None:
    f = tmp_path / "state.pt"
    f.write_bytes(b"x" * 10)
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(str(f))
    restored = ckpt.load_sync()
    assert restored is not None and restored.read_bytes() == b"x" * 10


@pytest.mark.parametrize(  # the default codec on every store, the others on two
    "codec", ["gzip", pytest.param("zstd", marks=ONE_OBJECT_STORE),
              pytest.param("none", marks=ONE_OBJECT_STORE)],
)
def test_directory_round_trip_is_the_same_tree(store_url: str, tmp_path: Path, codec: str) -> None:
    tree = _make_tree(tmp_path / "ckpts")
    ckpt = Checkpoint(store_url, codec=codec)
    ckpt.save_sync(tree)
    restored = ckpt.load_sync()
    assert restored is not None and restored.is_dir()
    assert restored.name == "ckpts"
    _assert_same_tree(restored, tree)
    assert (restored / "last.ckpt").read_text() == "hello"


def test_load_twice_gives_two_fresh_restores(store_url: str, tmp_path: Path) -> None:
    tree = _make_tree(tmp_path / "t")
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(tree)
    first = ckpt.load_sync()
    assert first is not None
    (first / "weights.bin").write_bytes(b"mutated by the user")
    second = ckpt.load_sync()
    assert second is not None and second != first
    assert (second / "weights.bin").read_bytes() == (tree / "weights.bin").read_bytes()


async def test_async_save_and_load(store_url: str) -> None:
    ckpt = Checkpoint(store_url)
    assert await ckpt.load() is None
    await ckpt.save(b"async")
    restored = await ckpt.load()
    assert restored is not None and restored.read_bytes() == b"async"


def test_a_format_1_directory_checkpoint_is_a_tarball_tar_reads(tmp_path: Path) -> None:
    tree = _make_tree(tmp_path / "t")
    store = tmp_path / "store"
    Checkpoint(str(store), store_format=1).save_sync(tree)
    (payload,) = (store / "checkpoints").glob("*.payload")
    listing = subprocess.run(
        ["tar", "tzf", str(payload)], check=True, capture_output=True, text=True
    ).stdout.split()
    assert {"weights.bin", "sub/deeper/notes.txt", "empty/", "last.ckpt", "run.sh"} <= set(listing)


@ONE_OBJECT_STORE
@pytest.mark.parametrize("bad", [123, None, 1.5, ["a"], {"a": 1}])
def test_save_rejects_other_types(store_url: str, bad: object) -> None:
    ckpt = Checkpoint(store_url)
    with pytest.raises(TypeError, match=r"bytes.*str / os\.PathLike"):
        ckpt.save_sync(bad)  # type: ignore[arg-type]


@ONE_OBJECT_STORE
def test_save_missing_path_raises_and_keeps_previous(store_url: str, tmp_path: Path) -> None:
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(b"good")
    with pytest.raises(FileNotFoundError, match="no such file"):
        ckpt.save_sync(tmp_path / "nope")
    restored = ckpt.load_sync()
    assert restored is not None and restored.read_bytes() == b"good"


def test_constructor_validates_arguments() -> None:
    with pytest.raises(ValueError, match="keep"):
        Checkpoint("memory://x", keep=0)
    with pytest.raises(ValueError, match="codec"):
        Checkpoint("memory://x", codec="lz4")
    with pytest.raises(ValueError, match="attempt"):
        Checkpoint("memory://x", attempt=-1)
    with pytest.raises(TypeError, match="url"):
        Checkpoint(42)  # type: ignore[arg-type]


def test_retention_keeps_only_newest(store_url: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0)
    for i in range(5):
        ckpt.save_sync(str(i).encode())
    names = _objects(store_url)
    assert len([n for n in names if n.endswith(".manifest.json")]) == 1
    assert len([n for n in names if n.endswith(".payload")]) == 1
    restored = ckpt.load_sync()
    assert restored is not None and restored.read_bytes() == b"4"


def test_keep_k(store_url: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0, keep=3)
    for i in range(6):
        ckpt.save_sync(str(i).encode())
    manifests = [m.seq for m in ckpt.committed()]
    assert manifests == [5, 4, 3]
    assert len([n for n in _objects(store_url) if n.endswith(".payload")]) == 3


def test_orphan_payload_from_a_crashed_save_is_cleaned(store_url: str) -> None:
    fs, path = _fs_path(store_url)
    Checkpoint(store_url, attempt=0).save_sync(b"a")
    fs.pipe_file(f"{path}/checkpoints/000000-000000007-deadbeef.payload", b"half written")
    ckpt = Checkpoint(store_url, attempt=1)
    assert ckpt.load_sync().read_bytes() == b"a"  # type: ignore[union-attr]
    ckpt.save_sync(b"b")
    assert "000000-000000007-deadbeef.payload" not in _objects(store_url)


def test_resumed_checkpoint_survives_until_a_newer_one_commits(store_url: str, tmp_path: Path) -> None:
    Checkpoint(store_url, attempt=0).save_sync(b"from attempt 0")
    second = Checkpoint(store_url, attempt=1)
    assert second.load_sync().read_bytes() == b"from attempt 0"  # type: ignore[union-attr]
    with pytest.raises(FileNotFoundError):
        second.save_sync(tmp_path / "missing")
    assert Checkpoint(store_url).load_sync().read_bytes() == b"from attempt 0"  # type: ignore[union-attr]


def test_lineage_reaches_past_an_attempt_that_never_saved(store_url: str) -> None:
    Checkpoint(store_url, attempt=0).save_sync(b"zero")
    assert Checkpoint(store_url, attempt=1).load_sync() is not None  # attempt 1 dies unsaved
    third = Checkpoint(store_url, attempt=2)
    assert third.load_sync().read_bytes() == b"zero"  # type: ignore[union-attr]


def test_newer_attempt_wins_over_older_zombie(store_url: str) -> None:
    zombie = Checkpoint(store_url, attempt=0, keep=2)
    fresh = Checkpoint(store_url, attempt=1, keep=2)
    zombie.save_sync(b"old-1")
    fresh.save_sync(b"new-1")
    zombie.save_sync(b"old-2")  # a zombie of attempt 0 commits late
    assert Checkpoint(store_url).load_sync().read_bytes() == b"new-1"  # type: ignore[union-attr]


def test_attempt_none_claims_new_numbers(store_url: str) -> None:
    first = Checkpoint(store_url)
    first.save_sync(b"1")
    second = Checkpoint(store_url)
    second.save_sync(b"2")
    assert (first.attempt, second.attempt) == (0, 1)
    assert Checkpoint(store_url).load_sync().read_bytes() == b"2"  # type: ignore[union-attr]


def test_same_attempt_in_a_new_process_does_not_overwrite(store_url: str) -> None:
    Checkpoint(store_url, attempt=3, keep=5).save_sync(b"first process")
    again = Checkpoint(store_url, attempt=3, keep=5)
    again.save_sync(b"second process")
    seqs = [m.seq for m in again.committed()]
    assert seqs == [1, 0]
    assert again.load_sync().read_bytes() == b"second process"  # type: ignore[union-attr]


# -- integrity ------------------------------------------------------------------------


def _payload_path(url: str, newest: bool = True) -> str:
    fs, path = _fs_path(url)
    payloads = sorted(p for p in fs.ls(f"{path}/checkpoints", detail=False) if p.endswith(".payload"))
    return payloads[-1] if newest else payloads[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_newest_is_skipped_with_a_warning(store_url: str, damage: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0, keep=2)
    ckpt.save_sync(b"older" * 100)
    ckpt.save_sync(b"newer" * 100)
    fs, _ = _fs_path(store_url)
    target = _payload_path(store_url)
    data = fs.cat_file(target)
    if damage == "flip":
        fs.pipe_file(target, data[:10] + bytes([data[10] ^ 0xFF]) + data[11:])
    elif damage == "truncate":
        fs.pipe_file(target, data[:100])
    else:
        fs.rm_file(target)
    with pytest.warns(TaskpointWarning, match="skipping checkpoint .*000000-000000001"):
        restored = Checkpoint(store_url).load_sync()
    assert restored is not None and restored.read_bytes() == b"older" * 100


@pytest.mark.parametrize("store_format", [1, 2])
def test_corrupt_directory_archive_is_skipped(
    store_url: str, tmp_path: Path, store_format: int
) -> None:
    ckpt = Checkpoint(store_url, attempt=0, keep=2, store_format=store_format)
    ckpt.save_sync(_make_tree(tmp_path / "a"))
    (tmp_path / "a" / "weights.bin").write_bytes(b"v2")
    ckpt.save_sync(tmp_path / "a")
    fs, path = _fs_path(store_url)
    if store_format == 1:
        target = _payload_path(store_url)
    else:  # the object only the newest checkpoint uses
        older, newer = ckpt.committed()[1], ckpt.committed()[0]
        (only,) = set(newer.objects or {}) - set(older.objects or {})
        target = f"{path}/objects/{only}"
    data = fs.cat_file(target)
    fs.pipe_file(target, data[: len(data) // 2])
    with pytest.warns(TaskpointWarning, match="skipping"):
        restored = Checkpoint(store_url).load_sync()
    assert restored is not None and (restored / "weights.bin").read_bytes() != b"v2"


def test_garbage_manifest_is_skipped(store_url: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0, keep=2)
    ckpt.save_sync(b"good")
    fs, path = _fs_path(store_url)
    fs.pipe_file(f"{path}/checkpoints/000009-000000000.manifest.json", b"{not json")
    with pytest.warns(TaskpointWarning, match="not valid JSON"):
        restored = ckpt.load_sync()
    assert restored is not None and restored.read_bytes() == b"good"


def test_all_corrupt_raises_instead_of_none(store_url: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0)
    ckpt.save_sync(b"only")
    fs, _ = _fs_path(store_url)
    fs.pipe_file(_payload_path(store_url), b"tampered")
    with pytest.warns(TaskpointWarning), pytest.raises(CheckpointCorruptError) as info:
        Checkpoint(store_url).load_sync()
    assert isinstance(info.value, taskpoint.CheckpointError)
    assert len(info.value.skipped) == 1 and "000000-000000000" in info.value.skipped[0]


def test_newer_manifest_format_says_upgrade(store_url: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0)
    ckpt.save_sync(b"x")
    fs, path = _fs_path(store_url)
    fs.pipe_file(f"{path}/checkpoints/000001-000000000.manifest.json", b'{"format": 99}')
    with pytest.raises(taskpoint.CheckpointFormatError, match="upgrade taskpoint"):
        ckpt.load_sync()


# -- concurrency ----------------------------------------------------------------------


def test_concurrent_saves_are_serialised_and_last_started_wins(store_url: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0)
    big = os.urandom(8 * 1024 * 1024)
    slow = threading.Thread(target=ckpt.save_sync, args=(big,))
    slow.start()
    time.sleep(0.01)
    ckpt.save_sync(b"started last")
    slow.join()
    assert Checkpoint(store_url).load_sync().read_bytes() == b"started last"  # type: ignore[union-attr]
    names = _objects(store_url)
    assert len([n for n in names if n.endswith(".manifest.json")]) == 1


async def test_concurrent_async_saves(store_url: str) -> None:
    ckpt = Checkpoint(store_url, attempt=0)
    await asyncio.gather(*(ckpt.save(str(i).encode()) for i in range(20)))
    restored = await Checkpoint(store_url).load()
    assert restored is not None and restored.read_bytes() == b"19"


# -- stores ---------------------------------------------------------------------------


def test_unknown_protocol_fails_at_first_use_naming_the_url() -> None:
    ckpt = Checkpoint("s4://bucket/prefix")  # no I/O at construction
    with pytest.raises(CheckpointStoreError, match=r"s4://bucket/prefix") as info:
        ckpt.save_sync(b"x")
    assert info.value.url == "s4://bucket/prefix"
    with pytest.raises(CheckpointStoreError, match="s4://bucket/prefix"):
        ckpt.load_sync()


def test_unwritable_root_names_the_url(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    url = f"file://{blocker}/store"
    with pytest.raises(CheckpointStoreError, match=str(blocker)):
        Checkpoint(url).save_sync(b"x")


def test_latest_checkpoint(tmp_path: Path) -> None:
    assert taskpoint.latest_checkpoint(None) is None
    assert taskpoint.latest_checkpoint(tmp_path / "missing") is None
    assert taskpoint.latest_checkpoint(tmp_path) is None
    for i, sub in enumerate(["a", "b/c", "d"]):
        f = tmp_path / sub / "last.ckpt"
        f.parent.mkdir(parents=True)
        f.write_text(sub)
        os.utime(f, (1000 + i * (1 if sub != "b/c" else 10), 1000 + i * (1 if sub != "b/c" else 10)))
    assert taskpoint.latest_checkpoint(tmp_path) == tmp_path / "b/c/last.ckpt"
    assert taskpoint.latest_checkpoint(tmp_path, "*/last.ckpt") == tmp_path / "d/last.ckpt"
    by_name = taskpoint.latest_checkpoint(tmp_path, key=lambda p: str(p))
    assert by_name == tmp_path / "d/last.ckpt"
    single = tmp_path / "a" / "last.ckpt"
    assert taskpoint.latest_checkpoint(single) == single

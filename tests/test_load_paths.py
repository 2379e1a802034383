"""``Checkpoint.load_sync(paths=...)``: restoring some paths of a format-2 tree.

On every store kind: the paths asked for come back exactly (with their directories and the
files their hard links share), the objects other files use are never read, a path the
newest checkpoint lacks raises without falling back to an older checkpoint, and bad
``paths`` are refused before anything is read.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import taskpoint
from taskpoint.format.manifest import Manifest, check_paths
from taskpoint.store.store import Store

BIG = 3 * 2**20


def _tree(root: Path) -> dict[str, str]:
    """Each path under ``root``: ``dir``, ``-> target`` for a link, else the file's size."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = str(path.stat().st_size)
    return found


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A tree of every entry type: the big file's objects are what a subset must not read."""
    root = tmp_path / "run"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_text("alpha")
    (root / "sub" / "b.bin").write_bytes(os.urandom(300_000))
    (root / "sub" / "deep" / "c.txt").write_text("gamma")
    (root / "big.bin").write_bytes(os.urandom(BIG))
    os.symlink("a.txt", root / "link")
    os.link(root / "sub" / "b.bin", root / "twin")
    return root


class Reads:
    """Records the objects a restore reads from the store, and the bytes it gets back."""

    def __init__(self) -> None:
        self.objects: set[str] = set()
        self.bytes = 0


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reads]:
    seen = Reads()
    read_bytes, read_range, local_path = Store.read_bytes, Store.read_range, Store.local_path

    def record(name: str, data: bytes | None) -> None:
        if name.startswith("objects/"):
            seen.objects.add(name.removeprefix("objects/"))
            seen.bytes += 0 if data is None else len(data)

    def whole(self: Store, name: str) -> bytes:
        data = read_bytes(self, name)
        record(name, data)
        return data

    def ranged(self: Store, name: str, start: int, end: int) -> bytes:
        data = read_range(self, name, start, end)
        record(name, data)
        return data

    def mapped(self: Store, name: str) -> str | None:
        local = local_path(self, name)
        if local is not None:
            record(name, None)  # mapped, not read: only the objects count
        return local

    monkeypatch.setattr(Store, "read_bytes", whole)
    monkeypatch.setattr(Store, "read_range", ranged)
    monkeypatch.setattr(Store, "local_path", mapped)
    yield seen


def _objects_of(manifest: Manifest, paths: set[str]) -> set[str]:
    return {b.object for e in manifest.entries or () if e.path in paths for b in e.blobs}


def test_only_the_paths_asked_for_are_read_and_restored(
    store_url: str, source: Path, reads: Reads
) -> None:
    taskpoint.Checkpoint(store_url).save_sync(source)
    manifest = taskpoint.Checkpoint(store_url).committed()[0]
    by_path = {e.path: e for e in manifest.entries or ()}
    moved: list[int] = []
    reads.objects.clear()

    restored = taskpoint.Checkpoint(store_url, progress=moved.append).load_sync(
        paths=["sub/deep/c.txt"]
    )
    assert restored is not None and restored.name == "run"
    assert _tree(restored) == {"sub": "dir", "sub/deep": "dir", "sub/deep/c.txt": "5"}
    assert (restored / "sub" / "deep" / "c.txt").read_text() == "gamma"
    assert sum(moved) == 5
    assert reads.objects == _objects_of(manifest, {"sub/deep/c.txt"})
    assert not reads.objects & _objects_of(manifest, {"big.bin"}) - _objects_of(
        manifest, {"sub/deep/c.txt"}
    )
    if not Store(store_url).is_local:  # the one blob's bytes, by a ranged read
        assert reads.bytes == sum(b.length for b in by_path["sub/deep/c.txt"].blobs)
        assert reads.bytes < BIG


def test_directories_links_and_hard_links_bring_what_they_need(
    store_url: str, source: Path, reads: Reads
) -> None:
    taskpoint.Checkpoint(store_url).save_sync(source)
    ckpt = taskpoint.Checkpoint(store_url)
    manifest = ckpt.committed()[0]
    by_path = {e.path: e for e in manifest.entries or ()}
    link, content = (
        ("sub/b.bin", "twin") if by_path["sub/b.bin"].type == "hardlink" else ("twin", "sub/b.bin")
    )
    assert by_path[link].type == "hardlink" and by_path[link].target == content

    # A hard link brings the file it shares, wherever it lies, and they stay one file.
    restored = ckpt.load_sync(paths=[link])
    assert restored is not None
    assert set(_tree(restored)) == {link, content, "sub"}
    assert os.path.samefile(restored / link, restored / content)
    assert (restored / link).read_bytes() == (source / "sub" / "b.bin").read_bytes()

    # A directory brings everything under it (a trailing '/' is dropped).
    for asked in ("sub", "sub/"):
        restored = ckpt.load_sync(paths=[asked])
        assert restored is not None
        assert set(_tree(restored)) == {
            "sub", "sub/deep", "sub/deep/c.txt", "sub/b.bin", "twin"
        }
    restored = ckpt.load_sync(paths=["empty"])
    assert restored is not None and _tree(restored) == {"empty": "dir"}

    # A symbolic link comes as a link; its target only when asked for.
    restored = ckpt.load_sync(paths=["link"])
    assert restored is not None and _tree(restored) == {"link": "-> a.txt"}
    restored = ckpt.load_sync(paths=("link", "a.txt"))
    assert restored is not None and (restored / "link").read_text() == "alpha"

    reads.objects.clear()
    restored = ckpt.load_sync(paths=[])
    assert restored is not None and _tree(restored) == {}
    assert reads.objects == set()

    # Everything asked for, one by one: the whole tree again.
    restored = ckpt.load_sync(paths={e.path for e in manifest.entries or ()})
    whole = ckpt.load_sync()
    assert restored is not None and whole is not None
    assert _tree(restored) == _tree(whole) == _tree(source)


def test_a_missing_path_raises_naming_it_and_never_loads_an_older_checkpoint(
    store_url: str, source: Path, reads: Reads
) -> None:
    ckpt = taskpoint.Checkpoint(store_url, keep=2)
    ckpt.save_sync(source)  # holds big.bin
    (source / "big.bin").unlink()
    ckpt.save_sync(source)
    reads.objects.clear()
    with pytest.raises(
        taskpoint.CheckpointCoordinationError, match=r"holds no 'big\.bin', 'nope'.*paths=None"
    ):
        taskpoint.Checkpoint(store_url).load_sync(paths=["a.txt", "big.bin", "nope"])
    assert reads.objects == set()
    with pytest.raises(taskpoint.CheckpointCoordinationError, match=r"holds no 'link/x'"):
        taskpoint.Checkpoint(store_url).load_sync(paths=["link/x"])  # under a link: no entry


@pytest.mark.parametrize(
    "bad",
    ["a.txt", b"a.txt", 3, ["/a.txt"], ["../a.txt"], ["sub/../a.txt"], ["./a.txt"], [""],
     ["a//b"], [None], [b"a.txt"], ["a\x00b"], ["/"]],
)
def test_bad_paths_are_refused_saying_what_is_accepted(tmp_path: Path, bad: object) -> None:
    url = f"file://{tmp_path / 'store'}"
    taskpoint.Checkpoint(url).save_sync(b"x")
    with pytest.raises(ValueError, match=r"relative paths inside the tree.*or None"):
        taskpoint.Checkpoint(url).load_sync(paths=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"relative paths inside the tree"):
        check_paths(bad)


def test_check_paths_normalises_and_dedups() -> None:
    assert check_paths(["a/b/", "a/b", ".metadata"]) == {"a/b", ".metadata"}
    assert check_paths(()) == frozenset()


def test_paths_of_a_checkpoint_that_is_not_a_tree_are_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    taskpoint.Checkpoint(url).save_sync(b"bytes")
    with pytest.raises(taskpoint.CheckpointCoordinationError, match=r"bytes checkpoint.*paths=None"):
        taskpoint.Checkpoint(url).load_sync(paths=["checkpoint.bin"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("f")
    taskpoint.Checkpoint(url, store_format=1).save_sync(tmp_path / "d")
    with pytest.raises(taskpoint.CheckpointCoordinationError, match="store format 1"):
        taskpoint.Checkpoint(url).load_sync(paths=["f"])


def test_paths_with_part_restore_that_parts_paths_only(
    store_url: str, tmp_path: Path, reads: Reads
) -> None:
    folders = []
    for rank in (0, 1):
        folder = tmp_path / f"rank-{rank}"
        (folder / "d").mkdir(parents=True)
        (folder / "d" / f"shard-{rank}").write_bytes(os.urandom(300_000))
        (folder / f"extra-{rank}").write_text(f"extra {rank}")
        folders.append(folder)
    commit = taskpoint.Checkpoint(store_url).begin_parts()
    commit.commit([taskpoint.Checkpoint(store_url).upload_part(f) for f in folders])
    manifest = taskpoint.Checkpoint(store_url).committed()[0]

    # Any rank's files, without the part: what a rank resharding a load needs.
    reads.objects.clear()
    restored = taskpoint.Checkpoint(store_url).load_sync(paths=["d/shard-1"])
    assert restored is not None and _tree(restored) == {"d": "dir", "d/shard-1": "300000"}
    assert reads.objects == _objects_of(manifest, {"d/shard-1"})
    assert not reads.objects & _objects_of(manifest, {"d/shard-0"})

    restored = taskpoint.Checkpoint(store_url).load_sync(part=1, paths=["d"])
    assert restored is not None and _tree(restored) == {"d": "dir", "d/shard-1": "300000"}
    with pytest.raises(
        taskpoint.CheckpointCoordinationError, match=r"the part of rank 1\) holds no 'extra-0'"
    ):
        taskpoint.Checkpoint(store_url).load_sync(part=1, paths=["extra-0"])
    with pytest.raises(taskpoint.CheckpointCoordinationError, match="no part of rank 2"):
        taskpoint.Checkpoint(store_url).load_sync(part=2, paths=["extra-0"])


def test_paths_into_a_folder_and_async_load(store_url: str, source: Path, tmp_path: Path) -> None:
    taskpoint.Checkpoint(store_url).save_sync(source)
    into = tmp_path / "into"
    into.mkdir()
    (into / "stale.txt").write_text("removed")
    ckpt = taskpoint.Checkpoint(store_url)
    assert ckpt.load_sync(into=into, paths=["a.txt"]) == into
    assert _tree(into) == {"a.txt": "5"}
    # Again with more: a.txt is kept, only the new path is fetched.
    moved: list[int] = []
    again = taskpoint.Checkpoint(store_url, progress=moved.append)
    assert again.load_sync(into=into, paths=["a.txt", "sub/deep"]) == into
    assert _tree(into) == {"a.txt": "5", "sub": "dir", "sub/deep": "dir", "sub/deep/c.txt": "5"}
    assert sum(moved) == 5

    restored = asyncio.run(taskpoint.Checkpoint(store_url).load(paths=["sub/deep/c.txt"]))
    assert restored is not None and (restored / "sub" / "deep" / "c.txt").read_text() == "gamma"

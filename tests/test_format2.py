"""Store format 2: directories stored once by content, restored in parallel, collected safely.

Every test runs on real stores (``store_url``: file, memory, S3, Azure, GCS servers) or real
processes; nothing here mocks the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import fsspec
import pytest
import taskpoint
from taskpoint import Checkpoint, CheckpointUnsafeError, SaveStats, TaskpointWarning
from taskpoint.format import retention
from taskpoint.format.manifest import Blob, Entry, Manifest, tree_checksum

LOCAL = pytest.mark.stores("file", "s3")
"""For what happens on the local disk (which files a save reads, which a restore into a
folder trusts or links, a tree refused before any upload), the same whatever the store: the
file store and one object store are enough."""

MiB = 2**20


def _fs_path(url: str) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(url)  # type: ignore[no-any-return]


def _shards(root: Path, n: int = 8, size: int = MiB, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"shard-{i}.bin").write_bytes(os.urandom(size) if seed < 0 else _data(i + seed, size))
    (root / "config.json").write_text(json.dumps({"layers": list(range(200))}))
    (root / "tokenizer").mkdir(exist_ok=True)
    for i in range(20):
        (root / "tokenizer" / f"vocab-{i}.txt").write_text(f"token {i}\n" * 50)
    return root


def _data(seed: int, size: int) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


def _stats(ckpt: Checkpoint) -> list[SaveStats]:
    seen: list[SaveStats] = []
    ckpt.on_commit(seen.append)
    return seen


def _same_tree(a: Path, b: Path) -> None:
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*"))
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*"))
    for name in names:
        pa, pb = a / name, b / name
        if pa.is_symlink():
            assert os.readlink(pa) == os.readlink(pb)
        elif pa.is_file():
            assert pa.read_bytes() == pb.read_bytes(), name
            assert pa.stat().st_mode == pb.stat().st_mode
            assert pa.stat().st_mtime_ns == pb.stat().st_mtime_ns


def test_unchanged_and_one_changed_shard_upload_only_what_changed(store_url: str, tmp_path: Path) -> None:
    tree = _shards(tmp_path / "tree")
    ckpt = Checkpoint(store_url, keep=3)
    stats = _stats(ckpt)
    ckpt.save_sync(tree)
    ckpt.save_sync(tree)
    (tree / "shard-3.bin").write_bytes(_data(99, MiB))
    ckpt.save_sync(tree)
    first, unchanged, one = stats
    assert first.uploaded > 8 * MiB * 0.99 and first.reused == 0
    assert unchanged.uploaded == 0 and unchanged.reused == unchanged.size
    assert one.uploaded <= 1.05 * MiB
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None
    _same_tree(tree, restored)


@pytest.mark.parametrize("others", [0, 2])
def test_a_save_whose_only_new_content_is_an_empty_file_commits(
    store_url: str, tmp_path: Path, others: int
) -> None:
    """DCP writes an empty ``__<rank>_0.distcp`` for a rank with nothing to save; an object
    of size 0 must be as good as any other (it once raised a bare ``KeyError``)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(others):
        (tree / f"data-{i}.bin").write_bytes(_data(i, 4096))
    ckpt = Checkpoint(store_url)
    if others:
        ckpt.save_sync(tree)
    (tree / "__0_0.distcp").write_bytes(b"")
    ckpt.save_sync(tree)
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None
    assert (restored / "__0_0.distcp").read_bytes() == b""
    _same_tree(tree, restored)


def test_every_kind_of_entry_round_trips(store_url: str, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "empty").mkdir()
    (tree / "big.bin").write_bytes(_data(1, 3 * MiB))
    (tree / "sub" / "deeper" / "notes.txt").write_text("hello\n" * 1000)
    (tree / "zero").write_bytes(b"")
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod(0o755)
    (tree / "link").symlink_to("sub/deeper/notes.txt")
    os.link(tree / "big.bin", tree / "hard.bin")
    os.utime(tree / "zero", ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    Checkpoint(store_url).save_sync(tree)
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None
    _same_tree(tree, restored)
    assert (restored / "hard.bin").stat().st_ino == (restored / "big.bin").stat().st_ino
    (manifest,) = Checkpoint(store_url).committed()
    assert manifest.format == 2 and manifest.is_tree
    # The text compressed, the random bytes did not; small files share one pack.
    blobs = {e.path: e.blobs for e in manifest.entries or ()}
    assert blobs["sub/deeper/notes.txt"][0].codec == "gzip"
    assert {b.codec for b in blobs["big.bin"]} == {"none"} and len(blobs["big.bin"]) > 1
    assert blobs["run.sh"][0].object == blobs["sub/deeper/notes.txt"][0].object


def test_restoring_into_a_folder_fetches_only_what_is_missing(store_url: str, tmp_path: Path) -> None:
    tree = _shards(tmp_path / "tree")
    Checkpoint(store_url).save_sync(tree)
    into = tmp_path / "into"
    moved: list[int] = []
    assert Checkpoint(store_url, progress=moved.append).load_sync(into=into) == into
    _same_tree(tree, into)
    assert sum(moved) >= 8 * MiB
    moved.clear()
    (into / "shard-5.bin").write_bytes(b"damaged locally")
    (into / "stray.txt").write_text("not in the checkpoint")
    assert Checkpoint(store_url, progress=moved.append).load_sync(into=into) == into
    _same_tree(tree, into)
    assert MiB <= sum(moved) < 1.1 * MiB
    moved.clear()
    Checkpoint(store_url, progress=moved.append).load_sync(into=into)
    assert sum(moved) == 0


@LOCAL
def test_a_kept_file_restores_its_hard_links_too(store_url: str, tmp_path: Path) -> None:
    """A file kept from ``into`` used to replace the restored one after its hard links were
    made to it, so they kept the empty file the extractor had created."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "b").write_bytes(b"shared content")
    os.link(tree / "b", tree / "h")
    Checkpoint(store_url).save_sync(tree)
    into = tmp_path / "into"
    into.mkdir()
    (into / "b").write_bytes(b"shared content")  # right content: kept, not downloaded

    assert Checkpoint(store_url).load_sync(into=into) == into
    assert (into / "h").read_bytes() == (into / "b").read_bytes() == b"shared content"
    assert (into / "h").stat().st_ino == (into / "b").stat().st_ino


def _reads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """The files saves read, and the files restores into a folder hash, by name."""
    from taskpoint.format import _tree_restore, _tree_save

    read: list[str] = []
    hashed: list[str] = []
    pieces, matches = _tree_save._pieces, _tree_restore._matches

    def counting_pieces(path: Path, *args: Any) -> Any:
        read.append(path.name)
        return pieces(path, *args)

    def counting_matches(path: Path, entry: Any) -> bool:
        hashed.append(path.name)
        return matches(path, entry)

    monkeypatch.setattr(_tree_save, "_pieces", counting_pieces)
    monkeypatch.setattr(_tree_restore, "_matches", counting_matches)
    return read, hashed


def _settle() -> None:
    """Wait until files written so far have times a stat cache may trust."""
    from taskpoint.format._statcache import SLACK_NS

    time.sleep(2 * SLACK_NS / 1e9)


@LOCAL
def test_a_save_reads_only_files_whose_stat_changed(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = _shards(tmp_path / "tree", n=3)
    _settle()
    read, _ = _reads(monkeypatch)
    ckpt = Checkpoint(store_url, keep=3)
    stats = _stats(ckpt)
    ckpt.save_sync(tree)
    assert "shard-0.bin" in read
    read.clear()
    ckpt.save_sync(tree)
    assert read == [] and stats[-1].uploaded == 0 and stats[-1].reused == stats[-1].size
    # Same size, and the old mtime put back: the ctime still tells.
    shard = tree / "shard-1.bin"
    old = shard.stat()
    shard.write_bytes(_data(42, MiB))
    os.utime(shard, ns=(old.st_atime_ns, old.st_mtime_ns))
    (tree / "new.txt").write_text("written just before the save")
    ckpt.save_sync(tree)
    assert sorted(read) == ["new.txt", "shard-1.bin"] and stats[-1].uploaded >= MiB
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None
    _same_tree(tree, restored)
    # Another Checkpoint object knows nothing: it reads everything.
    read.clear()
    Checkpoint(store_url, keep=3).save_sync(tree)
    assert len(read) == len([p for p in tree.rglob("*") if p.is_file()])


@LOCAL
def test_files_changed_too_recently_to_tell_are_read_again(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from taskpoint.format import _statcache

    tree = _shards(tmp_path / "tree", n=2)
    monkeypatch.setattr(_statcache, "SLACK_NS", 10**15)  # every time is too recent
    monkeypatch.setattr(_statcache, "COARSE_SLACK_NS", 10**15)
    read, hashed = _reads(monkeypatch)
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(tree)
    read.clear()
    ckpt.save_sync(tree)
    assert "shard-0.bin" in read and "config.json" in read
    into = tmp_path / "into"
    ckpt.load_sync(into=into)
    ckpt.load_sync(into=into)
    assert "shard-0.bin" in hashed


@LOCAL
def test_a_restore_into_a_folder_trusts_only_files_it_wrote_and_nobody_touched(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = _shards(tmp_path / "tree", n=3)
    writer = Checkpoint(store_url)
    writer.save_sync(tree)
    _settle()
    _, hashed = _reads(monkeypatch)
    into = tmp_path / "into"
    ckpt = Checkpoint(store_url)
    assert ckpt.load_sync(into=into) == into
    assert hashed == []  # nothing there yet
    assert ckpt.load_sync(into=into) == into
    assert hashed == []  # all known: none hashed, none fetched
    _same_tree(tree, into)
    # Edited in place, same size, old times put back: hashed, found wrong, fetched again.
    shard = into / "shard-2.bin"
    old = shard.stat()
    with open(shard, "r+b") as fh:
        fh.write(b"edited")
    os.utime(shard, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert shard.stat().st_size == old.st_size and shard.stat().st_mtime_ns == old.st_mtime_ns
    assert ckpt.load_sync(into=into) == into
    assert hashed == ["shard-2.bin"]
    _same_tree(tree, into)
    # A save of the restored folder trusts the files the restore wrote.
    read, _ = _reads(monkeypatch)
    ckpt.save_sync(into)
    assert read == []


def test_a_missing_or_damaged_object_falls_back_naming_it(store_url: str, tmp_path: Path) -> None:
    tree = _shards(tmp_path / "tree", n=2)
    ckpt = Checkpoint(store_url, keep=2)
    ckpt.save_sync(tree)
    (tree / "shard-1.bin").write_bytes(_data(7, MiB))
    ckpt.save_sync(tree)
    newest, older = ckpt.committed()
    fresh = sorted(set(newest.objects or {}) - set(older.objects or {}))
    fs, path = _fs_path(store_url)
    fs.rm_file(f"{path}/objects/{fresh[0]}")
    with pytest.warns(TaskpointWarning, match=f"{fresh[0]}.*missing"):
        restored = Checkpoint(store_url).load_sync()
    assert restored is not None and (restored / "shard-1.bin").read_bytes() == _data(1, MiB)
    assert not ckpt.verify(newest) and ckpt.verify(older)


def test_an_object_a_load_found_damaged_is_uploaded_again_not_reused(
    store_url: str, tmp_path: Path
) -> None:
    tree = _shards(tmp_path / "tree", n=2)
    ckpt = Checkpoint(store_url, keep=2)
    stats = _stats(ckpt)
    ckpt.save_sync(tree)
    (tree / "shard-1.bin").write_bytes(_data(7, MiB))
    ckpt.save_sync(tree)
    newest, older = ckpt.committed()
    fresh = sorted(set(newest.objects or {}) - set(older.objects or {}))
    fs, path = _fs_path(store_url)
    fs.pipe_file(f"{path}/objects/{fresh[0]}", b"damaged")
    with pytest.warns(TaskpointWarning, match=f"{fresh[0]}.*damaged"):
        restored = ckpt.load_sync()
    assert restored is not None and (restored / "shard-1.bin").read_bytes() == _data(1, MiB)
    ckpt.save_sync(tree)  # the same content again: the broken object must not be referenced
    assert stats[-1].uploaded >= (newest.objects or {})[fresh[0]]
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None and (restored / "shard-1.bin").read_bytes() == _data(7, MiB)
    assert ckpt.verify(ckpt.committed()[0])


def _plant_tree(url: str, entries: list[Entry], seq: int = 0) -> None:
    fs, path = _fs_path(url)
    fs.makedirs(f"{path}/checkpoints", exist_ok=True)
    objects = {b.object: b.offset + b.length for e in entries for b in e.blobs}
    manifest = Manifest(
        kind="directory", name="tree", codec="none", size=sum(e.size for e in entries),
        checksum=tree_checksum(tuple(entries)), payload=None, attempt=0, seq=seq,
        created=time.time(), format=2, entries=tuple(entries), objects=objects,
    )
    fs.pipe_file(f"{path}/checkpoints/{manifest.key}", manifest.to_json())


def _file(path: str) -> Entry:
    import xxhash

    digest = xxhash.xxh3_128_hexdigest(b"x")
    return Entry(path, "file", 0o644, 0, 1, f"xxh3-128:{digest}",
                 (Blob("0" * 32, 0, 1, "none", 1, digest),))


@pytest.mark.parametrize(
    "entries",
    [
        [_file("/etc/evil")],
        [_file("../evil")],
        [_file("a/../../evil")],
        [_file("same"), _file("same")],
        [Entry("link", "symlink", target="/etc"), _file("link/passwd")],
        [Entry("link", "symlink", target="../outside")],
        [Entry("d", "dir", 0o755), Entry("d/up", "symlink", target="../..")],
        [Entry("hard", "hardlink", target="/etc/passwd")],
    ],
    ids=["absolute", "dotdot", "climbs", "duplicate", "under-a-symlink", "link-leaves",
         "nested-link-leaves", "hardlink-outside"],
)
def test_a_manifest_naming_a_path_outside_the_tree_is_refused(
    tmp_path: Path, entries: list[Entry]
) -> None:
    url = f"file://{tmp_path / 'store'}"
    fs, path = _fs_path(url)
    fs.makedirs(f"{path}/objects", exist_ok=True)
    fs.pipe_file(f"{path}/objects/{'0' * 32}", b"x")
    _plant_tree(url, entries)
    with pytest.raises(CheckpointUnsafeError):
        Checkpoint(url, workdir=tmp_path / "restore").load_sync()
    assert not (tmp_path / "evil").exists() and not (tmp_path / "outside").exists()


def _bytes_allocated(fn: Callable[[], object], code: CodeType) -> int:
    """The bytes ``fn`` allocates in all, summed over each line run of ``code``: memory
    freed and allocated again counts every time (unlike a peak), and the count is the same
    on every run (unlike a time)."""
    import tracemalloc

    total = 0
    start = 0

    def line(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal total, start
        current, peak = tracemalloc.get_traced_memory()
        total += max(0, peak - start)
        tracemalloc.reset_peak()
        start = current
        return line

    def call(frame: FrameType, event: str, arg: object) -> Any:
        return line if frame.f_code is code else None

    previous = sys.gettrace()
    tracemalloc.start()
    sys.settrace(call)
    try:
        fn()
    finally:
        sys.settrace(previous)
        tracemalloc.stop()
    return total


def test_grouping_a_packs_blobs_into_reads_is_linear_in_its_blobs() -> None:
    """A pack of small files holds thousands of blobs: grouping them into the ranges to
    read must cost in proportion to them. It copied each range's member list for every
    blob it added (60k tiny files took 39 CPU-s to restore, 25 of them there)."""
    from taskpoint.format import _tree_restore

    def places(n: int) -> list[Any]:
        digest = "0" * 32
        return [
            _tree_restore._Place(Path(f"f{i}"), 0, Blob(digest, 10 * i, 10, "none", 10, digest))
            for i in range(n)
        ]

    small, large = places(4000), places(8000)
    assert [len(m) for _, _, m in _tree_restore._spans(large)] == [8000]  # one read
    code = _tree_restore._spans.__code__
    cost = [_bytes_allocated(lambda p=p: _tree_restore._spans(p), code) for p in (small, large)]
    assert cost[1] <= 2.5 * cost[0], f"{cost[0]:,} bytes for 4000 blobs, {cost[1]:,} for 8000"


@LOCAL
def test_a_symlink_out_of_the_tree_fails_the_save_before_any_upload(
    store_url: str, tmp_path: Path
) -> None:
    tree = _shards(tmp_path / "tree", n=1)
    (tree / "escape").symlink_to("/etc/passwd")
    with pytest.raises(CheckpointUnsafeError, match="escape"):
        Checkpoint(store_url).save_sync(tree)
    fs, path = _fs_path(store_url)
    assert not fs.exists(f"{path}/objects") or not fs.ls(f"{path}/objects")


def test_pruned_checkpoints_objects_are_collected_and_the_kept_ones_load(
    store_url: str, tmp_path: Path
) -> None:
    tree = _shards(tmp_path / "tree", n=2)
    ckpt = Checkpoint(store_url, keep=1)
    for generation in range(3):
        (tree / "shard-0.bin").write_bytes(_data(100 + generation, MiB))
        ckpt.save_sync(tree)
    (manifest,) = ckpt.committed()
    fs, path = _fs_path(store_url)
    assert {p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/objects", detail=False)} == set(
        manifest.objects or {}
    )
    # No lease is left (SeaweedFS keeps an empty "leases/" folder marker: not a lease).
    assert [p for p in fs.find(f"{path}/leases") if p.endswith(".json")] == []
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None
    _same_tree(tree, restored)


def test_a_live_lease_stops_collection_and_a_stale_one_does_not(
    store_url: str, tmp_path: Path
) -> None:
    tree = _shards(tmp_path / "tree", n=1)
    ckpt = Checkpoint(store_url, keep=3)
    ckpt.save_sync(tree)
    fs, path = _fs_path(store_url)
    fs.pipe_file(f"{path}/objects/{'f' * 32}", b"left by a crashed save")
    lease = f"{path}/leases/000009-000000000-zombie00.json"
    fs.pipe_file(lease, json.dumps({"at": time.time()}).encode())
    skipped = ckpt.collect()
    assert skipped.objects == 0 and skipped.skipped and "in flight" in skipped.skipped
    fs.pipe_file(lease, json.dumps({"at": time.time() - 2 * retention.LEASE_STALE_S}).encode())
    done = ckpt.collect()
    assert done.objects == 1 and done.bytes == len(b"left by a crashed save")
    assert not fs.exists(lease)
    assert Checkpoint(store_url).load_sync() is not None


def test_a_save_waits_for_a_running_collection(store_url: str, tmp_path: Path) -> None:
    tree = _shards(tmp_path / "tree", n=1)
    fs, path = _fs_path(store_url)
    fs.pipe_file(f"{path}/gc.lock", json.dumps({"at": time.time(), "token": "x"}).encode())
    ckpt = Checkpoint(store_url)
    saving = threading.Thread(target=ckpt.save_sync, args=(tree,))
    saving.start()
    time.sleep(1.0)
    assert ckpt.committed() == [] and saving.is_alive()
    fs.rm_file(f"{path}/gc.lock")
    saving.join(30)
    assert len(ckpt.committed()) == 1


def test_a_save_whose_lease_went_stale_does_not_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path / 'store'}"
    tree = _shards(tmp_path / "tree", n=1)
    monkeypatch.setattr(retention, "LEASE_STALE_S", 0.0)
    with pytest.raises(taskpoint.CheckpointStoreError, match="unrefreshed"):
        Checkpoint(url).save_sync(tree)
    assert Checkpoint(url).committed() == []


WRITER = textwrap.dedent(
    """
    import os, random, sys
    from pathlib import Path
    import taskpoint

    url, tree, rounds = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    ckpt = taskpoint.Checkpoint(url, keep=1)
    rng = random.Random(os.getpid())
    tree.mkdir(parents=True, exist_ok=True)
    for generation in range(rounds):
        for i in range(3):
            (tree / f"shard-{i}.bin").write_bytes(rng.randbytes(300_000 + rng.randrange(2) * 200_000))
        (tree / "generation.txt").write_text(str(generation))
        ckpt.save_sync(tree)
        print(generation, flush=True)
    """
)


def _every_committed_loads(url: str) -> int:
    ckpt = Checkpoint(url)
    manifests = ckpt.committed()
    for manifest in manifests:
        assert ckpt.verify(manifest), manifest.key
    return len(manifests)


def test_two_writers_and_gc_racing_in_threads(store_url: str, tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            ckpt = Checkpoint(store_url, keep=1)
            tree = tmp_path / f"tree-{n}"
            for generation in range(4):
                _shards(tree, n=2, size=300_000, seed=n * 100 + generation)
                ckpt.save_sync(tree)
        except BaseException as exc:
            errors.append(exc)

    def collector() -> None:
        try:
            for _ in range(20):
                Checkpoint(store_url).collect()
                time.sleep(0.02)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    threads.append(threading.Thread(target=collector))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert _every_committed_loads(store_url) >= 1
    assert Checkpoint(store_url).load_sync() is not None


def test_two_writers_and_gc_racing_in_processes(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, url, str(tmp_path / f"t{n}"), "6"],
                         stdout=subprocess.PIPE, text=True)
        for n in range(2)
    ]
    gc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, taskpoint\n"
         "for _ in range(30):\n"
         "    taskpoint.Checkpoint(sys.argv[1]).collect(); time.sleep(0.05)\n", url]
    )
    for proc in [*writers, gc]:
        assert proc.wait(300) == 0
    assert _every_committed_loads(url) >= 1


def test_sigkill_mid_save_never_loses_a_committed_checkpoint(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    for round_ in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, url, str(tmp_path / "tree"), "1000"],
            stdout=subprocess.PIPE, text=True,
        )
        assert child.stdout is not None
        child.stdout.readline()
        time.sleep(0.05 * round_)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert _every_committed_loads(url) >= 1
        restored = Checkpoint(url).load_sync()
        assert restored is not None and (restored / "generation.txt").exists()
        # Collection after a crash frees only what no committed manifest needs.
        Checkpoint(url).collect()
        assert _every_committed_loads(url) >= 1


def test_format_1_and_2_checkpoints_of_one_run_load_and_prune_together(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    tree = _shards(tmp_path / "tree", n=1)
    Checkpoint(url, keep=3, store_format=1).save_sync(tree)
    ckpt = Checkpoint(url, keep=1)
    ckpt.save_sync(tree)
    assert [m.format for m in ckpt.committed()] == [2]
    restored = Checkpoint(url).load_sync()
    assert restored is not None
    _same_tree(tree, restored)
    assert not list((tmp_path / "store" / "checkpoints").glob("*.payload"))

"""Background saves: snapshot now, upload later, errors surface, the runtime waits."""

from __future__ import annotations

import asyncio
import errno
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import taskpoint
from fsspec.implementations.memory import MemoryFileSystem
from taskpoint import Checkpoint, CheckpointStoreError, RetryPolicy


class SlowMemoryFileSystem(MemoryFileSystem):
    """In-memory store whose payload writes take ``delay`` seconds, or fail; ``writing``
    is set once one has begun."""

    protocol = ("slowmem",)
    delay: ClassVar[float] = 0.0
    fail: ClassVar[bool] = False
    writing: ClassVar[threading.Event] = threading.Event()

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and path.endswith(".payload"):
            self.writing.set()
            time.sleep(self.delay)
            if self.fail:
                raise OSError(errno.EIO, "503 Service Unavailable")
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("slowmem", SlowMemoryFileSystem, clobber=True)


@pytest.fixture
def slow_url() -> str:
    SlowMemoryFileSystem.delay = 0.0
    SlowMemoryFileSystem.fail = False
    SlowMemoryFileSystem.writing.clear()
    return f"slowmem://bg/{uuid.uuid4().hex}"


def test_background_save_returns_before_the_upload(slow_url: str) -> None:
    SlowMemoryFileSystem.delay = 2.0
    ckpt = Checkpoint(slow_url)
    started = time.monotonic()
    ckpt.save_sync(b"state", background=True)
    assert time.monotonic() - started < 1.0  # a wait for the upload would take over 2 s
    ckpt.wait()
    assert Checkpoint(slow_url).load_sync().read_bytes() == b"state"  # type: ignore[union-attr]


def test_snapshot_is_taken_before_returning(
    slow_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    SlowMemoryFileSystem.delay = 0.3
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "w.bin").write_bytes(b"v1")
    single = tmp_path / "model.pt"
    single.write_bytes(b"file-v1")
    ckpt = Checkpoint(slow_url, keep=1)
    ckpt.save_sync(tree, background=True)
    (tree / "w.bin").write_bytes(b"v2-after-return")
    (tree / "new.bin").write_bytes(b"added later")
    ckpt.wait()
    restored = Checkpoint(slow_url).load_sync()
    assert restored is not None
    assert (restored / "w.bin").read_bytes() == b"v1" and not (restored / "new.bin").exists()
    ckpt.save_sync(single, background=True)
    single.write_bytes(b"file-v2")
    ckpt.wait()
    assert Checkpoint(slow_url).load_sync().read_bytes() == b"file-v1"  # type: ignore[union-attr]
    assert not list(private_tmp.glob(".taskpoint-snapshot-*")), "snapshots are removed"


def test_newer_save_supersedes_a_queued_one(slow_url: str) -> None:
    SlowMemoryFileSystem.delay = 0.3
    ckpt = Checkpoint(slow_url, keep=10)
    for i in range(5):
        ckpt.save_sync(str(i).encode(), background=True)
    ckpt.wait()
    seqs = [m.seq for m in ckpt.committed()]
    assert seqs[0] == 4, "the newest save always commits"
    assert len(seqs) < 5, "queued saves overtaken by newer ones are dropped"
    assert Checkpoint(slow_url).load_sync().read_bytes() == b"4"  # type: ignore[union-attr]


def test_background_errors_surface_at_wait_and_next_save(slow_url: str) -> None:
    ckpt = Checkpoint(slow_url, retry=RetryPolicy(attempts=1))
    ckpt.save_sync(b"good")
    SlowMemoryFileSystem.fail = True
    ckpt.save_sync(b"doomed", background=True)
    with pytest.raises(CheckpointStoreError, match="503"):
        ckpt.wait()
    ckpt.save_sync(b"doomed again", background=True)
    # until its upload has failed (the error stays kept for the next save to raise)
    assert ckpt._saves._background.idle(timeout=30), "the upload never ended"
    SlowMemoryFileSystem.fail = False
    with pytest.raises(CheckpointStoreError, match="503"):
        ckpt.save_sync(b"next")
    assert Checkpoint(slow_url).load_sync().read_bytes() == b"good"  # type: ignore[union-attr]


async def test_async_background_save(slow_url: str) -> None:
    SlowMemoryFileSystem.delay = 0.2
    ckpt = Checkpoint(slow_url)
    await ckpt.save(b"async-bg", background=True)
    ckpt.wait()
    restored = await Checkpoint(slow_url).load()
    assert restored is not None and restored.read_bytes() == b"async-bg"


@pytest.mark.parametrize("fails", [False, True])
def test_runtime_waits_for_pending_saves(slow_url: str, fails: bool) -> None:
    SlowMemoryFileSystem.delay = 0.4
    env = taskpoint.TaskEnvironment(name="bg", root=slow_url, run_id="r")

    @env.task(retries=0)
    def task() -> str:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        context.checkpoint.save_sync(b"pending at return", background=True)
        if fails:
            raise RuntimeError("attempt fails")
        return "done"

    if fails:
        with pytest.raises(RuntimeError):
            task()
    else:
        assert task() == "done"
    restored = Checkpoint(f"{slow_url}/bg.task/r").load_sync()
    assert restored is not None and restored.read_bytes() == b"pending at return"


def test_runtime_fails_an_attempt_whose_background_save_failed(slow_url: str) -> None:
    env = taskpoint.TaskEnvironment(name="bgfail", root=slow_url, run_id="r")
    attempts: list[int] = []

    @env.task(retries=1, backoff=0)
    def task() -> int:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        attempts.append(context.attempt or 0)
        SlowMemoryFileSystem.fail = context.attempt == 0
        context.checkpoint.save_sync(b"x", background=True)
        return len(attempts)

    assert task() == 2 and attempts == [0, 1]


def test_async_task_waits_too(slow_url: str) -> None:
    SlowMemoryFileSystem.delay = 0.3
    env = taskpoint.TaskEnvironment(name="bgasync", root=slow_url, run_id="r")

    @env.task
    async def task() -> None:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        await context.checkpoint.save(b"async pending", background=True)

    asyncio.run(task())
    restored = Checkpoint(f"{slow_url}/bgasync.task/r").load_sync()
    assert restored is not None and restored.read_bytes() == b"async pending"


def test_link_snapshot_never_commits_a_file_rewritten_in_place(tmp_path: Path) -> None:
    """A file rewritten in place after a hard-link snapshot took it is never committed
    half old, half new: the save either stores the snapshot's content whole or fails, and
    the store keeps the checkpoint before it."""
    import os

    ckpt = Checkpoint((tmp_path / "store").as_uri(), keep=5)
    before = tmp_path / "before"
    before.mkdir()
    (before / "marker").write_bytes(b"before")
    ckpt.save_sync(before)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "a-weights.bin").write_bytes(os.urandom(24 << 20))  # read first, for a while
    old, new = b"o" * (1 << 20), b"n" * (1 << 20)
    (folder / "state.bin").write_bytes(old)
    ckpt.save_sync(folder, background=True, snapshot="link")
    with (folder / "state.bin").open("r+b") as fh:  # a writer halfway through, in place
        fh.write(new[: len(new) // 2])
        fh.flush()
        try:
            ckpt.wait()
            refused = None
        except taskpoint.CheckpointSaveError as exc:
            refused = exc
        fh.write(new[len(new) // 2 :])
    restored = Checkpoint(ckpt.url).load_sync(into=tmp_path / "restored")
    assert restored is not None
    if refused is not None:
        assert "rewritten in place" in str(refused)
        assert (restored / "marker").read_bytes() == b"before"  # the checkpoint before it
    else:  # read before the writer began: the snapshot's content, whole
        assert (restored / "state.bin").read_bytes() == old


def test_link_snapshot_copies_small_files_so_rewriting_them_in_place_is_harmless(
    tmp_path: Path,
) -> None:
    """Frameworks rewrite small files in place (a model card, a trainer state) while the
    upload of the folder holding them runs; a link snapshot copies those, so the save
    commits the content they had when it was taken instead of failing."""
    import os

    from taskpoint.checkpoint._save import LINK_MIN

    ckpt = Checkpoint((tmp_path / "store").as_uri())
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "a-weights.bin").write_bytes(os.urandom(24 << 20))  # read first, for a while
    (folder / "README.md").write_text("model card, first version\n")
    assert (folder / "README.md").stat().st_size < LINK_MIN
    ckpt.save_sync(folder, background=True, snapshot="link")
    with (folder / "README.md").open("w") as fh:  # truncates and rewrites the same inode
        fh.write("model card, second vers")
        fh.flush()
        ckpt.wait()  # raises if the save was refused
        fh.write("ion\n")
    restored = Checkpoint(ckpt.url).load_sync(into=tmp_path / "restored")
    assert restored is not None
    assert (restored / "README.md").read_text() == "model card, first version\n"


def _until_writing() -> None:
    """Until a background save writes its payload to the store (not merely queued, or
    begun: one that has not reached the store yet would be stopped for a newer save)."""
    assert SlowMemoryFileSystem.writing.wait(timeout=30), "the upload never started"


def test_the_newest_of_saves_coalesced_behind_an_upload_commits_and_is_counted(
    slow_url: str,
) -> None:
    SlowMemoryFileSystem.delay = 2.0  # the four saves below take well under it, loaded or not
    ckpt = Checkpoint(slow_url, keep=10)
    stats: list[taskpoint.SaveStats] = []
    ckpt.on_commit(stats.append)
    ckpt.save_sync(b"0", background=True)
    _until_writing()
    for i in range(1, 5):
        started = time.monotonic()
        ckpt.save_sync(str(i).encode(), background=True)
        assert time.monotonic() - started < 0.5, "a save during an upload never waits for it"
    ckpt.wait()
    assert [s.coalesced for s in stats] == [0, 3]  # 1, 2 and 3 never uploaded
    newest, first = ckpt.committed()
    assert (newest.stats or {}).get("coalesced") == 3 and "coalesced" not in (first.stats or {})
    assert Checkpoint(slow_url).load_sync().read_bytes() == b"4"  # type: ignore[union-attr]


def test_a_blocking_save_replaces_the_waiting_one_and_reports_it(slow_url: str) -> None:
    SlowMemoryFileSystem.delay = 0.5
    ckpt = Checkpoint(slow_url, keep=10)
    stats: list[taskpoint.SaveStats] = []
    ckpt.on_commit(stats.append)
    ckpt.save_sync(b"running", background=True)
    _until_writing()
    ckpt.save_sync(b"waiting", background=True)
    ckpt.save_sync(b"preemption save")  # goes first: after the upload in flight, alone
    ckpt.wait()
    assert [(s.background, s.coalesced) for s in stats] == [(True, 0), (False, 1)]
    assert Checkpoint(slow_url).load_sync().read_bytes() == b"preemption save"  # type: ignore[union-attr]


def test_a_background_preemption_save_replaces_the_waiting_one(slow_url: str) -> None:
    SlowMemoryFileSystem.delay = 0.5
    ckpt = Checkpoint(slow_url, keep=10)
    stats: list[taskpoint.SaveStats] = []
    ckpt.on_commit(stats.append)
    ckpt.save_sync(b"running", background=True)
    _until_writing()
    ckpt.save_sync(b"waiting", background=True)
    taskpoint.preemption.relay(60.0)
    try:
        ckpt.save_sync(b"after the signal", background=True)
        ckpt.wait()
    finally:
        taskpoint.preemption.reset()
    assert [s.coalesced for s in stats] == [0, 1]
    newest = ckpt.committed()[0]
    assert newest.preemption and Checkpoint(slow_url).load_sync().read_bytes() == b"after the signal"  # type: ignore[union-attr]


def test_when_busy_wait_blocks_a_save_until_the_upload_in_flight_commits(
    slow_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    SlowMemoryFileSystem.delay = 0.5
    ckpt = Checkpoint(slow_url, keep=10, when_busy="wait")
    assert ckpt.when_busy == "wait"
    stats: list[taskpoint.SaveStats] = []
    ckpt.on_commit(stats.append)
    for i in range(3):
        started = time.monotonic()
        ckpt.save_sync(str(i).encode(), background=True)
        if i:
            assert time.monotonic() - started >= 0.3, "it waited for the upload in flight"
    ckpt.wait()
    assert [(s.seq, s.coalesced) for s in stats] == [(0, 0), (1, 0), (2, 0)]  # every one
    monkeypatch.setenv("TASKPOINT_WHEN_BUSY", "wait")
    assert Checkpoint(slow_url).when_busy == "wait"
    assert Checkpoint(slow_url, when_busy="coalesce").when_busy == "coalesce"
    monkeypatch.setenv("TASKPOINT_WHEN_BUSY", "sometimes")
    with pytest.raises(ValueError, match=r"TASKPOINT_WHEN_BUSY must be .coalesce.*'sometimes'"):
        Checkpoint(slow_url)
    with pytest.raises(ValueError, match="when_busy must be"):
        Checkpoint(slow_url, when_busy="block")  # type: ignore[arg-type]


def test_a_bad_upload_priority_is_refused_at_the_call(
    slow_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKPOINT_UPLOAD_NICE", "high")
    ckpt = Checkpoint(slow_url)
    with pytest.raises(ValueError, match="TASKPOINT_UPLOAD_NICE must be an int from 0"):
        ckpt.save_sync(b"x", background=True)
    ckpt.save_sync(b"x")  # a blocking save is never niced

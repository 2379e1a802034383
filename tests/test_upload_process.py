"""Background saves upload from a separate process, never holding the training loop's GIL."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from taskpoint import Checkpoint, CheckpointError, SaveStats, _uploader


def _upload_pid(ckpt: Checkpoint, timeout: float = 60.0) -> int:
    """The pid of ``ckpt``'s upload process, once its background thread has started it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker = ckpt._saves.worker
        proc = worker._proc if worker is not None else None
        if proc is not None:
            return proc.pid
        time.sleep(0.01)
    raise AssertionError("no upload process started")


def _tree(root: Path, mb: int, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "weights.bin").write_bytes(os.urandom(mb * 2**20))
    (root / "step.txt").write_text(str(seed))
    return root


def test_background_saves_upload_in_another_process_and_commit_in_order(
    store_url: str, tmp_path: Path
) -> None:
    if store_url.startswith("memory://"):
        pytest.skip("memory:// lives in one process: its background saves use a thread")
    ckpt = Checkpoint(store_url, keep=3, background_upload="process")
    stats: list[SaveStats] = []
    ckpt.on_commit(stats.append)
    first = _tree(tmp_path / "first", 8, seed=1)
    ckpt.save_sync(first, background=True)
    pid = _upload_pid(ckpt)
    assert pid != os.getpid()
    os.kill(pid, 0)  # alive
    ckpt.wait()
    ckpt.save_sync(_tree(tmp_path / "second", 16, seed=2), background=True)
    deadline = time.monotonic() + 30
    while not ckpt._saves._background._running and time.monotonic() < deadline:
        time.sleep(0.001)  # until the upload is in flight (a queued one would be superseded)
    ckpt.save_sync(b"third")  # waits for the upload in flight, then commits after it
    ckpt.wait()
    assert [(s.seq, s.kind, s.background) for s in stats] == [
        (0, "directory", True), (1, "directory", True), (2, "bytes", False),
    ]
    assert all(s.blocked_s <= s.save_s and s.uploaded == s.size for s in stats)
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None and restored.read_bytes() == b"third"
    assert [m.seq for m in Checkpoint(store_url).committed()] == [2, 1, 0]


def test_the_upload_process_runs_below_the_training_loops_priority(tmp_path: Path) -> None:
    ckpt = Checkpoint(tmp_path / "store", background_upload="process")
    ckpt.save_sync(b"x", background=True)
    pid = _upload_pid(ckpt)
    try:
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(
            os.getpriority(os.PRIO_PROCESS, 0) + _uploader.NICE, 19
        )
    finally:
        ckpt.wait()


def test_thread_mode_still_available(tmp_path: Path) -> None:
    ckpt = Checkpoint(tmp_path / "store", background_upload="thread")
    ckpt.save_sync(b"x", background=True)
    ckpt.wait()
    assert ckpt._saves.worker is None
    with pytest.raises(ValueError, match="background_upload"):
        Checkpoint(tmp_path / "store", background_upload="fork")


def test_a_killed_upload_process_fails_that_save_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ckpt = Checkpoint(store, keep=5, background_upload="process")
    ckpt.save_sync(b"committed before")
    ckpt.save_sync(_tree(tmp_path / "big", 64), background=True)
    os.kill(_upload_pid(ckpt), signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"upload process died.*SIGKILL"):
        ckpt.wait()
    restored = Checkpoint(store).load_sync()
    assert restored is not None and restored.read_bytes() == b"committed before"
    ckpt.save_sync(b"after", background=True)  # a fresh upload process takes over
    ckpt.wait()
    restored = Checkpoint(store).load_sync()
    assert restored is not None and restored.read_bytes() == b"after"


def test_the_upload_process_ignores_sigterm_and_finishes_its_upload(tmp_path: Path) -> None:
    """A preempted attempt waits for the upload in flight: SIGTERM, sent to the whole
    process group by launchers, must not kill it half-way."""
    store = tmp_path / "store"
    ckpt = Checkpoint(store, background_upload="process")
    ckpt.save_sync(_tree(tmp_path / "big", 64), background=True)
    pid = _upload_pid(ckpt)  # set once the process said it was ready
    os.kill(pid, signal.SIGTERM)
    ckpt.wait()
    restored = Checkpoint(store).load_sync()
    assert restored is not None and (restored / "weights.bin").stat().st_size == 64 * 2**20

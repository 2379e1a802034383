"""``JobMirror``, the job-wide folder mirror both framework adapters use: in one process it
has no nodes; in a real two-rank torchrun job (gloo) each rank's disk is committed as one
checkpoint, and another system's checkpoint is mirrored by rank zero alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import taskpoint
from taskpoint.checkpoint.job_mirror import JobMirror
from taskpoint.distributed import nodes

RANK = Path(__file__).with_name("tp_job_mirror_rank.py")
HANG_S = 600
"""Bounds the torchrun job (two ranks importing torch, however loaded the machine): only a
hang reaches it."""


def test_in_one_process_a_job_mirror_has_no_nodes_and_saves_alone(tmp_path: Path) -> None:
    job = JobMirror(taskpoint.Checkpoint(tmp_path / "store"), timeout=30)
    assert job.join(tmp_path / "out") is None and job.leads
    assert job.gather("x") == ["x"]
    with pytest.raises(RuntimeError, match=r"call join\(\) on every rank"):
        job.save_parts(tmp_path / "out", step=1)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "weights.bin").write_bytes(b"w")
    job.uploads.save(tmp_path / "out", step=1)
    assert job.finish(30, leader=True) and job.finish(30, leader=False)
    assert len(taskpoint.Checkpoint(tmp_path / "store").committed()) == 1


@pytest.mark.parametrize("blocking", [True, False])
def test_alone_the_leader_saves_the_folder_logs_it_and_lets_the_upload_process_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    blocking: bool,
) -> None:
    released: list[object] = []
    release = taskpoint.Checkpoint.release
    monkeypatch.setattr(
        taskpoint.Checkpoint, "release", lambda self: (released.append(self), release(self))
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "weights.bin").write_bytes(b"w")
    checkpoint = taskpoint.Checkpoint(tmp_path / "store")
    job = JobMirror(checkpoint, blocking=blocking, timeout=30)
    assert job.join(tmp_path / "out") is None
    assert job.background is not blocking  # the checkpoint's own background save
    assert job.save(tmp_path / "out", step=1, leader=False) is False
    assert not job.uploads.uploading and checkpoint.committed() == []
    with caplog.at_level("INFO", logger="taskpoint.checkpoint.job_mirror"):
        assert job.save(tmp_path / "out", step=2, leader=True) is True
    verb = "saved" if blocking else "started saving"
    assert f"{verb} {tmp_path / 'out'} (step 2) to {checkpoint!r} in " in caplog.text
    assert job.finish(30, leader=True)
    assert [s.step for s in job.uploads.take_stats()] == [2]
    assert len(checkpoint.committed()) == 1
    job.release()  # the checkpoint stays open: it saves again
    assert released == [checkpoint]
    assert job.save(tmp_path / "out", step=3, leader=True) and job.finish(30, leader=True)
    assert [s.step for s in job.uploads.take_stats()] == [3]
    JobMirror(_FailingCheckpoint()).release()  # another system's checkpoint: nothing to do


@pytest.mark.slow
def test_every_rank_commits_its_disk_as_one_checkpoint(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(RANK), store,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: disks 2 leads True" in out
        assert f"rank {rank}: stale left []" in out  # the staging folder a kill left is gone
        assert f"rank {rank}: gathered [0, 1]" in out
        assert f"rank {rank}: finished True" in out
        assert f"rank {rank}: staging left ['checkpoint-6']" in out
        assert f"rank {rank}: plain nodes None leads True" in out
        assert f"rank {rank}: done" in out
    # another system's checkpoint: rank zero alone says the other node's files are not saved
    assert "rank 0: warnings 1" in out and "rank 1: warnings 0" in out

    checkpoint = taskpoint.Checkpoint(store)
    (newest,) = checkpoint.committed()
    assert newest.step == 6
    restored = checkpoint.load_sync()
    assert restored is not None and restored.name == "out"  # rank 0's folder name
    assert nodes.list_files(restored) == [
        "checkpoint-6/model.bin", "checkpoint-6/rng_state_0.pth", "checkpoint-6/rng_state_1.pth",
    ]
    assert (restored / "checkpoint-6" / "rng_state_1.pth").read_text() == (
        "rng_state_1.pth from rank 1"
    )


class _FailingCheckpoint:
    """Any system's checkpoint whose saves fail (a store that is down)."""

    async def save(self, data: object, /) -> None:
        raise taskpoint.CheckpointStoreError("store is down", url="test://down")

    def save_sync(self, data: object, /) -> None:
        raise taskpoint.CheckpointStoreError("store is down", url="test://down")

    async def load(self) -> Path | None:
        return None

    def load_sync(self) -> Path | None:
        return None


def test_settle_waits_for_the_upload_and_logs_a_failure_instead_of_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "weights.bin").write_bytes(b"w")
    job = JobMirror(taskpoint.Checkpoint(tmp_path / "store"), blocking=False, timeout=30)
    assert job.settle(30) is None  # nothing in flight
    job.uploads.save(tmp_path / "out", step=1)
    assert job.settle(30) is True and job.lost is None
    assert len(taskpoint.Checkpoint(tmp_path / "store").committed()) == 1

    broken = JobMirror(_FailingCheckpoint(), blocking=False, timeout=30)
    broken.uploads.save(tmp_path / "out", step=2)
    with caplog.at_level("INFO", logger="taskpoint"):
        broken.settle_failed(RuntimeError("boom"), 30, 2)
    assert isinstance(broken.lost, taskpoint.CheckpointStoreError)
    assert "failed: CheckpointStoreError: store is down" in caplog.text
    assert "training ended by RuntimeError at step 2; the upload in flight committed" in caplog.text
    assert broken.settle(30) is None  # the failure is not raised again


class _StalledCheckpoint(_FailingCheckpoint):
    """Any system's checkpoint whose saves wait until :attr:`go` is set (a stalled store)."""

    def __init__(self) -> None:
        self.go = threading.Event()

    async def save(self, data: object, /) -> None:
        self.save_sync(data)

    def save_sync(self, data: object, /) -> None:
        assert self.go.wait(30)


def test_finish_says_on_the_leader_when_the_last_upload_outlasts_its_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "weights.bin").write_bytes(b"w")
    stalled = _StalledCheckpoint()
    job = JobMirror(stalled, blocking=False, timeout=30)
    assert job.save(tmp_path / "out", step=1, leader=True)
    with caplog.at_level("WARNING", logger="taskpoint"):
        assert job.finish(0.2, leader=False) is True  # not the rank that saves: no wait
        assert "still runs" not in caplog.text
        assert job.finish(0.2, leader=True) is False
    assert f"the upload to {stalled!r} still runs after 0.2s; not waiting for it" in caplog.text
    stalled.go.set()
    assert job.finish(30, leader=True) is True

"""FolderMirror: a save asked for while an upload runs never waits for it; the snapshot of
the newest waits behind the upload and commits next, the ones it replaced are counted."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from taskpoint import Checkpoint
from taskpoint.checkpoint.mirror import FolderMirror, MirrorStats, combined_metrics


class GatedMemoryFileSystem(MemoryFileSystem):
    """An in-memory store whose blob writes wait while the test holds its gate."""

    protocol = ("gatedmem",)
    gate = threading.Event()
    held = threading.Event()

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and "/objects/" in path and not self.gate.is_set():
            self.held.set()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("gatedmem", GatedMemoryFileSystem, clobber=True)


@pytest.fixture
def gated_url() -> Any:
    GatedMemoryFileSystem.gate.clear()
    GatedMemoryFileSystem.held.clear()
    yield f"gatedmem://mirror/{uuid.uuid4().hex}"
    GatedMemoryFileSystem.gate.set()


def _write(folder: Path, step: int) -> Path:
    """Replace the folder's files, as frameworks do (a new file renamed over the old): the
    snapshots' hard links keep their content. Writing in place would change a snapshot an
    upload still reads, which then refuses to commit (tested in test_background_save)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("weights.bin", bytes([step]) * (2 << 20)), ("step.txt", b"%d" % step)):
        (folder / f".{name}.new").write_bytes(data)
        os.replace(folder / f".{name}.new", folder / name)
    return folder


def test_a_mirror_save_during_an_upload_returns_and_the_newest_commits_next(
    gated_url: str, tmp_path: Path
) -> None:
    checkpoint = Checkpoint(gated_url, keep=5)
    mirror = FolderMirror(checkpoint)
    folder = tmp_path / "out"
    mirror.save(_write(folder, 1), step=1)
    assert GatedMemoryFileSystem.held.wait(timeout=30)  # its upload is in flight, held
    # a waiting save's cost; cancelled below, else it opens a later test's gate
    timer = threading.Timer(10.0, GatedMemoryFileSystem.gate.set)
    timer.start()
    for step in (2, 3, 4):
        _write(folder, step)  # the framework replaces the files, as Lightning does
        started = time.monotonic()
        mirror.save(folder, step=step)
        # the upload it would wait for is held until the gate opens: any bound shows it did
        # not wait; 20 s leaves a loaded CI machine room to copy 2 MiB
        assert time.monotonic() - started < 20, step
    assert mirror.uploading and checkpoint.committed() == []
    timer.cancel()
    GatedMemoryFileSystem.gate.set()
    assert mirror.wait()
    stats = mirror.take_stats()
    assert [(s.step, s.coalesced) for s in stats] == [(1, 0), (4, 2)]
    assert combined_metrics(stats)["taskpoint/coalesced"] == 2.0
    restored = Checkpoint(gated_url).load_sync()
    assert restored is not None and (restored / "step.txt").read_text() == "4"
    assert (restored / "weights.bin").read_bytes() == bytes([4]) * (2 << 20)
    assert len(checkpoint.committed()) == 2  # 2 and 3 were never uploaded


def test_a_mirror_whose_checkpoint_says_wait_waits(gated_url: str, tmp_path: Path) -> None:
    checkpoint = Checkpoint(gated_url, keep=5, when_busy="wait")
    mirror = FolderMirror(checkpoint)
    assert not mirror.coalesces
    folder = tmp_path / "out"
    mirror.save(_write(folder, 1), step=1)
    assert GatedMemoryFileSystem.held.wait(timeout=30)
    threading.Timer(1.0, GatedMemoryFileSystem.gate.set).start()
    started = time.monotonic()
    mirror.save(_write(folder, 2), step=2)
    assert time.monotonic() - started >= 0.5  # it waited for the first upload
    assert mirror.wait()
    assert [(s.step, s.coalesced) for s in mirror.take_stats()] == [(1, 0), (2, 0)]


class GatedPlainCheckpoint:
    """Another system's checkpoint object (no ``wait``): each save waits until the test
    opens ``gate`` (``held`` says one is waiting), then commits to a real
    :class:`taskpoint.Checkpoint`."""

    def __init__(self, inner: Checkpoint) -> None:
        self.inner = inner
        self.gate, self.held = threading.Event(), threading.Event()
        self.saved: list[str] = []

    def save_sync(self, data: Any) -> None:
        self.held.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        self.saved.append((Path(data) / "step.txt").read_text())
        self.inner.save_sync(data)

    async def save(self, data: Any) -> None:
        self.save_sync(data)

    def load_sync(self) -> Path | None:
        return self.inner.load_sync()

    async def load(self) -> Path | None:
        return self.load_sync()


def test_a_mirror_of_another_checkpoint_coalesces_on_its_own_thread(tmp_path: Path) -> None:
    plain = GatedPlainCheckpoint(Checkpoint(tmp_path / "store", keep=5))
    mirror = FolderMirror(plain, blocking=False)
    assert mirror.coalesces
    folder = tmp_path / "out"
    mirror.save(_write(folder, 1), step=1)
    assert plain.held.wait(timeout=30)  # the first upload has started, held at the gate
    for step in (2, 3, 4):
        started = time.monotonic()
        mirror.save(_write(folder, step), step=step)
        # the upload it would wait for is held until the gate opens: any bound shows it
        # did not wait
        assert time.monotonic() - started < 20, step
    assert plain.saved == []
    plain.gate.set()
    assert mirror.wait()
    assert plain.saved == ["1", "4"]
    stats = mirror.take_stats()
    assert [(s.step, s.coalesced) for s in stats] == [(1, 0), (4, 2)]
    assert isinstance(stats[0], MirrorStats)
    assert not list(tmp_path.glob(".taskpoint-snapshot-*")), "replaced snapshots are removed"


def test_a_preemption_save_drops_the_mirror_waiting_and_goes_first(
    gated_url: str, tmp_path: Path
) -> None:
    checkpoint = Checkpoint(gated_url, keep=5)
    mirror = FolderMirror(checkpoint)
    folder = tmp_path / "out"
    mirror.save(_write(folder, 1), step=1)
    assert GatedMemoryFileSystem.held.wait(timeout=30)
    mirror.save(_write(folder, 2), step=2)  # waits behind the upload
    assert mirror.drop_waiting() and not mirror.drop_waiting()
    mirror.save(_write(folder, 3), step=3)  # the preemption save: next after the upload
    GatedMemoryFileSystem.gate.set()
    assert mirror.wait()
    assert [(s.step, s.coalesced) for s in mirror.take_stats()] == [(1, 0), (3, 1)]
    restored = Checkpoint(gated_url).load_sync()
    assert restored is not None and (restored / "step.txt").read_text() == "3"

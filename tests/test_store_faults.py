"""Transient store faults are retried; persistent ones raise CheckpointStoreError."""

from __future__ import annotations

import errno
import logging
import uuid
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from taskpoint import Checkpoint, CheckpointStoreError, RetryPolicy


class FlakyMemoryFileSystem(MemoryFileSystem):
    """An in-memory filesystem whose calls fail while ``faults`` has entries left.

    Each entry is the exception the next matching call raises.
    """

    protocol = ("flakymem",)
    faults: ClassVar[list[BaseException]] = []
    calls: ClassVar[int] = 0

    def _maybe_fail(self) -> None:
        type(self).calls += 1
        if self.faults:
            raise self.faults.pop(0)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super().cat_file(path, *args, **kwargs)

    def _open(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super()._open(path, *args, **kwargs)

    def ls(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super().ls(path, *args, **kwargs)

    def pipe_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super().pipe_file(path, *args, **kwargs)


fsspec.register_implementation("flakymem", FlakyMemoryFileSystem, clobber=True)

FAST = RetryPolicy(attempts=4, initial=0.0, maximum=0.0)


@pytest.fixture
def flaky_url() -> str:
    FlakyMemoryFileSystem.faults = []
    FlakyMemoryFileSystem.calls = 0
    return f"flakymem://faults/{uuid.uuid4().hex}"


@pytest.mark.parametrize(
    "fault",
    [
        ConnectionResetError(errno.ECONNRESET, "connection reset by peer"),
        TimeoutError("read timed out"),
        OSError(errno.EIO, "503 Slow Down"),
    ],
    ids=["reset", "timeout", "throttled"],
)
def test_transient_faults_are_retried(
    flaky_url: str, fault: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpoint(flaky_url, retry=FAST)
    FlakyMemoryFileSystem.faults = [fault, fault]
    with caplog.at_level(logging.WARNING, logger="taskpoint"):
        ckpt.save_sync(b"survives")
    assert "retrying" in caplog.text
    FlakyMemoryFileSystem.faults = [fault, fault]
    restored = Checkpoint(flaky_url, retry=FAST).load_sync()
    assert restored is not None and restored.read_bytes() == b"survives"


def test_persistent_fault_raises_naming_url_and_cause(flaky_url: str) -> None:
    ckpt = Checkpoint(flaky_url, retry=FAST)
    ckpt.save_sync(b"committed")
    FlakyMemoryFileSystem.faults = [OSError(errno.EIO, "500 Internal Error")] * 20
    with pytest.raises(CheckpointStoreError, match=r"flakymem://faults/.*after 4 tries.*500 Internal Error"):
        ckpt.save_sync(b"lost")
    with pytest.raises(CheckpointStoreError, match="500 Internal Error"):
        ckpt.load_sync()
    FlakyMemoryFileSystem.faults = []
    restored = ckpt.load_sync()
    assert restored is not None and restored.read_bytes() == b"committed"


@pytest.mark.parametrize(
    "fault", [PermissionError(errno.EACCES, "AccessDenied"), ValueError("bad credentials")]
)
def test_permanent_faults_are_not_retried(flaky_url: str, fault: BaseException) -> None:
    ckpt = Checkpoint(flaky_url, retry=FAST)
    FlakyMemoryFileSystem.faults = [fault]
    with pytest.raises(CheckpointStoreError, match=flaky_url):
        ckpt.load_sync()
    assert FlakyMemoryFileSystem.calls == 1


def test_a_fault_is_never_reported_as_no_checkpoint(flaky_url: str) -> None:
    FlakyMemoryFileSystem.faults = [OSError(errno.EIO, "boom")] * 10
    with pytest.raises(CheckpointStoreError):
        Checkpoint(flaky_url, retry=FAST).load_sync()


def test_a_transaction_another_thread_holds_never_captures_a_save(tmp_path: Path) -> None:
    """fsspec keeps one transaction per filesystem instance, shared by every thread:
    Lightning writes each .ckpt inside ``fs.transaction`` on the cached local filesystem.
    A save streaming meanwhile must not join it (its commit would close the file)."""
    import threading

    url = f"file://{tmp_path / 'store'}"
    writing, release = threading.Event(), threading.Event()

    def progress(moved: int) -> None:
        if not writing.is_set():
            writing.set()
            assert release.wait(30)

    ckpt = Checkpoint(url, progress=progress, store_format=1)
    fs = ckpt._store.fs
    fs.start_transaction()  # another thread's transaction, open when the save starts
    errors: list[BaseException] = []

    def save() -> None:
        try:
            ckpt.save_sync(b"x" * 3_000_000)
        except BaseException as exc:
            errors.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    try:
        assert writing.wait(30)
    finally:
        fs.end_transaction()  # commits what joined it, mid-save
        release.set()
        saver.join(60)
    assert not errors, errors
    restored = Checkpoint(url).load_sync()
    assert restored is not None and restored.read_bytes() == b"x" * 3_000_000


def test_stall_timeout_comes_from_the_environment_and_sets_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TASKPOINT_STALL_TIMEOUT", raising=False)
    assert RetryPolicy().stall_timeout == 30.0
    # 5 tries of 30 s without progress, and the waits of 0.2, 0.4, 0.8 and 1.6 s between them
    assert RetryPolicy().budget() == pytest.approx(153.0)
    monkeypatch.setenv("TASKPOINT_STALL_TIMEOUT", "2.5")
    assert RetryPolicy().stall_timeout == 2.5
    assert RetryPolicy(stall_timeout=7).stall_timeout == 7.0  # the argument wins
    assert RetryPolicy(attempts=2, initial=1, stall_timeout=3).budget() == pytest.approx(7.0)
    assert RetryPolicy(stall_timeout=3) != RetryPolicy(stall_timeout=4)


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "inf", "nan"])
def test_a_bad_stall_timeout_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("TASKPOINT_STALL_TIMEOUT", raw)
    with pytest.raises(ValueError, match=rf"TASKPOINT_STALL_TIMEOUT must be a positive number of seconds; got '{raw}'"):
        Checkpoint("memory://stall/bad")


@pytest.mark.parametrize("value", [0, -1.0, float("inf")])
def test_a_bad_stall_timeout_argument_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="stall_timeout must be a positive number of seconds"):
        RetryPolicy(stall_timeout=value)

"""A fit leaves nothing of taskpoint's running: Lightning's own test harness fails a test
that leaves a thread behind (it stops daemon threads that have a ``stop`` method and
rejects any other), and a child process outliving the fit is as much a leak."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
from taskpoint.checkpoint import _uploader
from taskpoint_lightning import TaskpointModelCheckpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc"),
]


def _upload_processes() -> set[int]:
    """This process's running children that are upload processes (from ``/proc``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if stat[0] == "Z":  # ended, not yet reaped
            continue
        if int(stat[1]) == os.getpid() and _uploader.CHILD_MODULE.encode() in cmdline:
            found.add(int(entry.name))
    return found


def _taskpoint_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t for t in set(threading.enumerate()) - before
        if t.is_alive() and t.name.startswith("taskpoint")
    ]


def test_a_fit_leaves_no_taskpoint_thread_or_upload_process_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_uploader, "_shared", None)  # this test's own upload process
    threads_before = set(threading.enumerate())
    processes_before = _upload_processes()
    ckpt = taskpoint.Checkpoint(tmp_path / "store", keep=2)
    assert ckpt.load_sync() is None  # what a job does first; it starts the upload process
    assert _uploader.shared().wait_ready(60)
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True
    )
    lib.trainer([mc], max_epochs=1, default_root_dir=tmp_path).fit(
        lib.TinyModule(), lib.loader("plain")
    )
    assert ckpt._saves.process_uploads > 0  # the mirrors went through the upload process
    assert ckpt.closed  # teardown closed it
    # What Lightning's harness accepts right after the test: daemon threads it can stop.
    for thread in _taskpoint_threads(threads_before):
        assert thread.daemon and callable(getattr(thread, "stop", None)), thread
    deadline = time.monotonic() + _uploader.IDLE_EXIT_S + 30
    while _taskpoint_threads(threads_before) or _upload_processes() - processes_before:
        assert time.monotonic() < deadline, (
            f"left behind: {_taskpoint_threads(threads_before)}, "
            f"{_upload_processes() - processes_before}"
        )
        time.sleep(0.05)
    restored = taskpoint.Checkpoint(tmp_path / "store").load_sync()
    assert restored is not None and (restored / "last.ckpt").is_file()

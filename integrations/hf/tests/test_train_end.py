"""``train()`` leaves nothing of taskpoint's running, and its checkpoint still saves after.

At ``on_train_end`` the callback lets go of the shared upload process
(``Checkpoint.release``) without closing its checkpoint: the process and its reader thread
end at once (a test harness that rejects threads a test left running finds none), and a
later ``train()`` through the same callback and checkpoint takes the process up again.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import taskpoint
import taskpoint_hf_testkit as kit
from taskpoint.checkpoint import _uploader
from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc"
)

ENDED_WITHIN_S = _uploader.IDLE_EXIT_S - 2
"""Well under the idle time of a closed checkpoint's upload process."""


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
        if stat[0] != "Z" and int(stat[1]) == os.getpid() and _uploader.CHILD_MODULE.encode() in cmdline:
            found.add(int(entry.name))
    return found


def _assert_nothing_left(threads_before: set[threading.Thread], processes_before: set[int]) -> None:
    """Wait (at most :data:`ENDED_WITHIN_S`) until none of taskpoint's threads and no
    upload process started since the ``before`` sets runs."""
    def left() -> list[threading.Thread]:
        return [
            t for t in set(threading.enumerate()) - threads_before
            if t.is_alive() and t.name.startswith("taskpoint")
        ]

    started = time.monotonic()
    while left() or _upload_processes() - processes_before:
        assert time.monotonic() - started < ENDED_WITHIN_S, (
            f"left behind after train(): {left()}, {_upload_processes() - processes_before}"
        )
        time.sleep(0.05)


def test_train_leaves_nothing_running_and_a_second_train_saves_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_uploader, "_shared", None)  # this test's own upload process
    threads_before = set(threading.enumerate())
    processes_before = _upload_processes()
    ckpt = taskpoint.Checkpoint(tmp_path / "store", keep=2)
    out = tmp_path / "out"
    callback = TaskpointTrainerCallback(ckpt, str(out))
    assert restore_last_checkpoint(ckpt, out) is None  # loading readies the upload process
    assert _uploader.shared().wait_ready(60)
    kit.classifier_trainer(out, callbacks=[callback], max_steps=6).train()
    uploads = ckpt._saves.process_uploads
    assert uploads > 0 and not ckpt.closed
    _assert_nothing_left(threads_before, processes_before)

    resumed = restore_last_checkpoint(ckpt, out)
    assert resumed is not None and resumed.name == "checkpoint-6"
    assert _uploader.shared().wait_ready(60)
    trainer = kit.classifier_trainer(out, callbacks=[callback], max_steps=9)
    trainer.train(resume_from_checkpoint=str(resumed))
    assert trainer.state.global_step == 9
    assert ckpt._saves.process_uploads > uploads  # through a new upload process
    _assert_nothing_left(threads_before, processes_before)
    restored = taskpoint.Checkpoint(tmp_path / "store").load_sync()
    assert restored is not None and (restored / "checkpoint-9").is_dir()

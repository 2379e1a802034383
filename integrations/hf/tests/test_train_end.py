"""``train()`` leaves nothing of taskpoint's running, and its checkpoint still saves after.

At ``on_train_end`` the callback lets go of the shared upload process
(``Checkpoint.release``) without closing its checkpoint: the process and its reader thread
end at once (a test harness that rejects threads a test left running finds none), and a
later ``train()`` through the same callback and checkpoint takes the process up again.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import taskpoint
import taskpoint_hf_testkit as kit
from _leftovers import assert_nothing_left, upload_processes
from taskpoint.checkpoint import _uploader
from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint
from transformers import TrainerCallback

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc"
)

def test_train_leaves_nothing_running_and_a_second_train_saves_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_uploader, "_shared", None)  # this test's own upload process
    threads_before = set(threading.enumerate())
    processes_before = upload_processes()
    ckpt = taskpoint.Checkpoint(tmp_path / "store", keep=2)
    out = tmp_path / "out"
    callback = TaskpointTrainerCallback(ckpt, str(out))
    assert restore_last_checkpoint(ckpt, out) is None  # loading readies the upload process
    assert _uploader.shared().wait_ready(60)
    kit.classifier_trainer(out, callbacks=[callback], max_steps=6).train()
    uploads = ckpt._saves.process_uploads
    assert uploads > 0 and not ckpt.closed
    assert_nothing_left(threads_before, processes_before, after="train()")

    resumed = restore_last_checkpoint(ckpt, out)
    assert resumed is not None and resumed.name == "checkpoint-6"
    assert _uploader.shared().wait_ready(60)
    trainer = kit.classifier_trainer(out, callbacks=[callback], max_steps=9)
    trainer.train(resume_from_checkpoint=str(resumed))
    assert trainer.state.global_step == 9
    assert ckpt._saves.process_uploads > uploads  # through a new upload process
    assert_nothing_left(threads_before, processes_before, after="train()")
    restored = taskpoint.Checkpoint(tmp_path / "store").load_sync()
    assert restored is not None and (restored / "checkpoint-9").is_dir()


class _BreakStoreAt(TrainerCallback):
    """At step ``step``, once the uploads before it committed, puts a file where the
    store's folder was: every later upload fails."""

    def __init__(self, callback: TaskpointTrainerCallback, store: Path, step: int) -> None:
        self.callback, self.store, self.step = callback, store, step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.callback.wait()
            self.store.rename(self.store.with_name("moved"))
            self.store.write_text("a file where the store's folder was")


def test_a_train_whose_last_upload_fails_raises_and_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload at the end of training fails: ``train()`` raises it, and the callback
    still lets go of the upload process, as after a train that ended well."""
    monkeypatch.setattr(_uploader, "_shared", None)  # this test's own upload process
    threads_before = set(threading.enumerate())
    processes_before = upload_processes()
    store = tmp_path / "store"
    ckpt = taskpoint.Checkpoint(f"file://{store}", keep=2)
    out = tmp_path / "out"
    callback = TaskpointTrainerCallback(ckpt, str(out))
    assert restore_last_checkpoint(ckpt, out) is None  # loading readies the upload process
    assert _uploader.shared().wait_ready(60)
    trainer = kit.classifier_trainer(
        out, callbacks=[_BreakStoreAt(callback, store, 4), callback], max_steps=6
    )
    with pytest.raises(taskpoint.CheckpointStoreError, match="Not a directory"):
        trainer.train()
    assert ckpt._saves.process_uploads > 0 and not ckpt.closed
    assert_nothing_left(threads_before, processes_before, after="a train() that raised")

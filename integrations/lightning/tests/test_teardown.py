"""A fit leaves nothing of taskpoint's running, and its checkpoint still saves afterwards.

Lightning's own test harness fails a test that leaves a thread behind (it stops the daemon
threads that have a ``stop`` method and rejects any other), and an upload process
outliving the fit is as much a leak. At ``teardown`` the callback lets go of the shared
upload process (``Checkpoint.release``) without closing its checkpoint: the process and
its reader thread end at once, and a later fit through the same callback and checkpoint
takes the process up again.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from _leftovers import assert_nothing_left, upload_processes
from taskpoint.checkpoint import _uploader
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc"),
]

def test_a_fit_leaves_no_taskpoint_thread_or_upload_process_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_uploader, "_shared", None)  # this test's own upload process
    threads_before = set(threading.enumerate())
    processes_before = upload_processes()
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
    assert not ckpt.closed
    assert_nothing_left(threads_before, processes_before, after="the fit", non_daemon=True)
    restored = taskpoint.Checkpoint(tmp_path / "store").load_sync()
    assert restored is not None and (restored / "last.ckpt").is_file()


def test_a_second_fit_through_the_same_callback_saves_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_uploader, "_shared", None)
    threads_before = set(threading.enumerate())
    processes_before = upload_processes()
    ckpt = taskpoint.Checkpoint(tmp_path / "store", keep=2)
    dirpath = tmp_path / "ckpts"
    mc = TaskpointModelCheckpoint(ckpt, dirpath=dirpath, save_last=True)
    first = lib.TinyModule()
    assert resume_ckpt_path(ckpt, dirpath=dirpath) is None
    assert _uploader.shared().wait_ready(60)
    lib.trainer([mc], max_epochs=1, default_root_dir=tmp_path).fit(first, lib.loader("plain"))
    uploads = ckpt._saves.process_uploads
    assert uploads > 0
    assert_nothing_left(threads_before, processes_before, after="the fit", non_daemon=True)

    resumed = resume_ckpt_path(ckpt, dirpath=dirpath)  # loading takes the process up again
    assert resumed is not None and Path(resumed).name == "last.ckpt"
    assert _uploader.shared().wait_ready(60)
    second = lib.TinyModule()
    lib.trainer([mc], max_epochs=2, default_root_dir=tmp_path).fit(
        second, lib.loader("plain"), ckpt_path=resumed
    )
    assert second.started_at == (1, lib.SAMPLES // lib.BATCH)  # resumed after epoch 0
    assert ckpt._saves.process_uploads > uploads  # its mirrors went through a new process
    assert_nothing_left(threads_before, processes_before, after="the fit", non_daemon=True)
    restored = taskpoint.Checkpoint(tmp_path / "store").load_sync()
    assert restored is not None
    state = torch.load(restored / "last.ckpt", weights_only=False)
    assert state["epoch"] == 1 and state["global_step"] == 2 * lib.SAMPLES // lib.BATCH


class _BreakStoreAt(L.Callback):
    """At global step ``step``, once the uploads before it committed, puts a file where
    the store's folder was: every later upload fails."""

    def __init__(self, mc: TaskpointModelCheckpoint, store: Path, step: int) -> None:
        self.mc, self.store, self.step = mc, store, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.mc.wait()
            self.store.rename(self.store.with_name("moved"))
            self.store.write_text("a file where the store's folder was")


def test_a_fit_whose_last_upload_fails_raises_and_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload at the end of the fit fails: the fit raises it, and the callback still
    lets go of the upload process, as after a fit that ended well."""
    monkeypatch.setattr(_uploader, "_shared", None)  # this test's own upload process
    threads_before = set(threading.enumerate())
    processes_before = upload_processes()
    store = tmp_path / "store"
    ckpt = taskpoint.Checkpoint(f"file://{store}", keep=2)
    assert ckpt.load_sync() is None  # what a job does first; it starts the upload process
    assert _uploader.shared().wait_ready(60)
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True
    )
    trainer = lib.trainer(
        [_BreakStoreAt(mc, store, 3), mc], max_epochs=1, default_root_dir=tmp_path
    )
    with pytest.raises(taskpoint.CheckpointStoreError, match="Not a directory"):
        trainer.fit(lib.TinyModule(), lib.loader("plain"))
    assert ckpt._saves.process_uploads > 0 and not ckpt.closed
    assert_nothing_left(
        threads_before, processes_before, after="a fit that raised", non_daemon=True
    )

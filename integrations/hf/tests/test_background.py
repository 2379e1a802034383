"""Background uploads: training goes on while the store is written; the cost is logged.

Uploads are made slow on purpose with a real ``taskpoint.Checkpoint`` whose ``progress=``
callback (called as payload bytes stream) holds them while a gate is closed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _servers
import pytest
import taskpoint_hf_testkit as kit
from taskpoint import Checkpoint, CheckpointLike, CheckpointStoreError, RetryPolicy
from taskpoint.checkpoint import _uploader
from taskpoint_hf import TaskpointTrainerCallback, last_complete_checkpoint, restore_last_checkpoint
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

CHILD = Path(__file__).with_name("taskpoint_hf_child.py")
FEW_RETRIES = RetryPolicy(attempts=2, initial=0.1, maximum=0.2)
"""A dead server fails a save in about a second, not after the default's back-off."""


class Gate:
    """A ``progress=`` callback that holds every upload while the gate is closed."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.held = threading.Event()  # an upload has reached the closed gate

    def close(self) -> None:
        self._open.clear()

    def open_in(self, seconds: float) -> None:
        threading.Timer(seconds, self._open.set).start()

    def __call__(self, moved: int) -> None:
        if not self._open.is_set():
            self.held.set()
            assert self._open.wait(timeout=60), "the test never opened the gate"


class At(TrainerCallback):
    """Calls ``actions["<event>_<step>"]()`` at that event (``save`` or ``step``) and keeps
    what it returned in ``seen``."""

    def __init__(self, **actions: Callable[[], Any]) -> None:
        self.actions = actions
        self.seen: dict[str, Any] = {}

    def _at(self, event: str, state: TrainerState) -> None:
        key = f"{event}_{state.global_step}"
        if key in self.actions:
            self.seen[key] = self.actions[key]()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._at("save", state)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._at("step", state)


def _figures(result: kit.Result) -> list[dict[str, float]]:
    """The ``taskpoint/*`` metrics the run logged (as the first callback got them), oldest
    first; never in the Trainer's log history."""
    assert not any(k.startswith("taskpoint/") for h in result.extra["log_history"] for k in h)
    found = []
    for entry in result.extra["logs"]:
        mine = {k: v for k, v in entry.items() if k.startswith("taskpoint/")}
        if mine:
            found.append(mine)
    return found


@pytest.mark.parametrize("when_busy", ["coalesce", "wait"])
def test_a_save_during_an_upload_waits_behind_it_and_the_end_commits_the_newest(
    tmp_path: Path, when_busy: str
) -> None:
    gate = Gate()
    checkpoint = Checkpoint(
        f"file://{tmp_path / 'store'}", keep=5, progress=gate,
        when_busy=when_busy,  # type: ignore[arg-type]
    )

    def committed() -> int:
        return len(checkpoint.committed())

    def open_soon() -> int:
        gate.open_in(3.0)
        return committed()

    at = At(save_3=gate.close, step_4=committed, step_5=open_soon)
    callback = TaskpointTrainerCallback(checkpoint)
    result = kit.run_classifier(None, tmp_path / "out", callbacks=[at, callback], max_steps=6)

    # Steps 4 and 5 trained while checkpoint-3's upload was held at the gate.
    assert gate.held.is_set()
    assert at.seen == {"save_3": None, "step_4": 0, "step_5": 0}
    # The save at step 6 waited behind that upload (or, with when_busy="wait", for it).
    # Training's end waits for both: with "wait" both commit, in order; with "coalesce"
    # the newest goes first, and the upload still held stops, uncommitted.
    committed = [
        (m.attempt, m.seq, (m.stats or {}).get("coalesced")) for m in checkpoint.committed()
    ]
    if when_busy == "wait":
        assert committed == [(0, 1, None), (0, 0, None)]
    else:
        assert committed == [(0, 1, 1)]
    restored = checkpoint.load_sync()
    assert restored is not None
    assert last_complete_checkpoint(restored) == restored / "checkpoint-6"
    figures = _figures(result)
    assert sum(f["taskpoint/saves"] for f in figures) == len(committed)
    assert sum(f.get("taskpoint/coalesced", 0) for f in figures) == 2 - len(committed)
    if when_busy == "wait":
        assert max(f["taskpoint/blocked_s"] for f in figures) >= 2.0  # step 6 waited for 3
    else:
        assert max(f["taskpoint/blocked_s"] for f in figures) < 1.5  # it never waited


def test_logged_figures_are_plausible(tmp_path: Path) -> None:
    gate = Gate()
    store = tmp_path / "store"
    # Format 1: one payload per save, so the figures can be checked against its file.
    checkpoint = Checkpoint(f"file://{store}", keep=5, progress=gate, store_format=1)
    stats: list[Any] = []
    checkpoint.on_commit(stats.append)

    def held_then_open() -> None:
        # checkpoint-3's upload is under way (a loaded machine may start it after training
        # ends; the end's wait would then stop it for checkpoint-6, as it should)
        assert gate.held.wait(timeout=30)
        gate.open_in(1.0)

    at = At(save_3=gate.close, step_4=held_then_open)
    callback = TaskpointTrainerCallback(checkpoint)
    result = kit.run_classifier(
        None, tmp_path / "out", callbacks=[at, callback], max_steps=6, save_steps=3
    )

    figures = _figures(result)
    assert sum(f["taskpoint/saves"] for f in figures) == 2  # checkpoint-3 and checkpoint-6
    assert all(0 <= f["taskpoint/blocked_s"] < f["taskpoint/upload_s"] for f in figures)
    assert max(f["taskpoint/upload_s"] for f in figures) >= 0.5  # held at the gate
    uploaded = sum(f["taskpoint/uploaded_bytes"] for f in figures)
    assert uploaded == sum(s.size for s in stats)  # format 1 uploads every payload whole
    assert figures[-1]["taskpoint/stored_bytes"] == stats[-1].size
    payloads = sorted((store / "checkpoints").glob("*.payload"))
    assert sorted(p.stat().st_size for p in payloads) == sorted(s.size for s in stats)
    assert all(isinstance(v, float) for f in figures for v in f.values())


@pytest.mark.parametrize(("max_steps", "where"), [(9, "next save"), (6, "train end")])
def test_a_failed_upload_is_raised_and_the_previous_checkpoint_still_loads(
    tmp_path: Path, max_steps: int, where: str
) -> None:
    parent = tmp_path / "parent"
    checkpoint = Checkpoint(f"file://{parent / 'store'}", keep=5)
    callback = TaskpointTrainerCallback(checkpoint)
    saves: list[int] = []

    def break_store() -> None:
        callback.wait()  # checkpoint-3 is committed
        parent.rename(tmp_path / "parent.moved")
        parent.write_text("a file where the store's folder was")

    at = At(step_4=break_store, save_6=lambda: saves.append(6), save_9=lambda: saves.append(9))
    with pytest.raises(CheckpointStoreError, match="Not a directory"):
        kit.run_classifier(
            None, tmp_path / "out", callbacks=[at, callback], max_steps=max_steps
        )
    assert saves == ([6, 9] if where == "next save" else [6])

    parent.unlink()
    (tmp_path / "parent.moved").rename(parent)
    resumed = restore_last_checkpoint(Checkpoint(f"file://{parent / 'store'}"), tmp_path / "again")
    assert resumed == tmp_path / "again" / "checkpoint-3"


def test_an_upload_to_a_stopped_server_is_raised_at_the_next_save(
    seaweed_server: Any, tmp_path: Path
) -> None:
    """The default upload process, on SeaweedFS behind a proxy that goes down like a dead
    server after checkpoint-3 committed: checkpoint-6's upload fails in the upload process,
    the save at step 9 raises it, and once the server is back checkpoint-3 still loads."""
    url = seaweed_server.url("taskpoint-tests", uuid.uuid4().hex)
    with _servers.FaultProxy(seaweed_server) as proxy:
        options = proxy.storage_options()
        checkpoint = Checkpoint(url, keep=5, storage_options=options, retry=FEW_RETRIES)
        assert _uploader.shared().wait_ready(60)  # so the uploads below run there
        callback = TaskpointTrainerCallback(checkpoint)
        saves: list[int] = []

        def stop_server() -> None:
            callback.wait()  # checkpoint-3 is committed
            proxy.down()

        at = At(step_4=stop_server, save_6=lambda: saves.append(6),
                save_9=lambda: saves.append(9))
        with pytest.raises(CheckpointStoreError):
            kit.run_classifier(None, tmp_path / "out", callbacks=[at, callback], max_steps=9)
        assert saves == [6, 9]  # checkpoint-6's upload failed; the save at step 9 raised it
        assert checkpoint._saves.process_uploads > 0  # they ran in the upload process

        proxy.up()
        again = Checkpoint(url, storage_options=options)
        resumed = restore_last_checkpoint(again, tmp_path / "again")
        assert resumed == tmp_path / "again" / "checkpoint-3"


class FailingSecondSave:
    """Another system's checkpoint (no ``wait``, no ``on_commit``): its second save fails."""

    def __init__(self, inner: CheckpointLike) -> None:
        self.inner, self.calls = inner, 0

    def save_sync(self, data: Any, /) -> None:
        self.calls += 1
        if self.calls == 2:
            raise OSError("the other store is down")
        self.inner.save_sync(data)

    async def save(self, data: Any, /) -> None:
        self.save_sync(data)

    def load_sync(self) -> Path | None:
        return self.inner.load_sync()

    async def load(self) -> Path | None:
        return self.inner.load_sync()


def test_another_checkpoint_type_uploads_from_the_adapters_thread(tmp_path: Path) -> None:
    other = FailingSecondSave(Checkpoint(f"file://{tmp_path / 'store'}"))
    # Background on another system's checkpoint only when asked (the default blocks).
    callback = TaskpointTrainerCallback(other, tmp_path / "out", blocking=False)
    threads: list[str] = []
    real = other.save_sync

    def recording(data: Any, /) -> None:
        threads.append(threading.current_thread().name)
        assert Path(data).name == "out" and Path(data) != tmp_path / "out"  # a snapshot
        real(data)

    other.save_sync = recording  # type: ignore[method-assign]

    def failed() -> None:  # the save at step 6 has failed before the one at step 9 starts
        deadline = time.monotonic() + 60
        while other.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # from its raise to the thread keeping the error

    with pytest.raises(OSError, match="the other store is down"):
        kit.run_classifier(None, tmp_path / "out", callbacks=[At(step_8=failed), callback],
                           max_steps=9)
    assert threads == ["taskpoint-mirror-upload"] * 2  # raised at the save at step 9
    restored = other.load_sync()
    assert restored is not None and last_complete_checkpoint(restored) == restored / "checkpoint-3"


def test_blocking_keeps_the_synchronous_upload(tmp_path: Path) -> None:
    store = tmp_path / "store"
    checkpoint = Checkpoint(f"file://{store}", keep=10)
    callback = TaskpointTrainerCallback(checkpoint, blocking=True)

    def committed() -> int:
        return len(checkpoint.committed())

    at = At(save_3=committed, save_6=committed, save_9=committed)
    result = kit.run_classifier(None, tmp_path / "out", callbacks=[callback, at], max_steps=9)
    assert at.seen == {"save_3": 1, "save_6": 2, "save_9": 3}  # committed inside on_save
    figures = _figures(result)
    assert sum(f["taskpoint/saves"] for f in figures) == 3
    for f in figures:
        assert f["taskpoint/blocked_s"] >= f["taskpoint/upload_s"] > 0


@pytest.mark.parametrize("bad", [-1, True, "60"])
def test_bad_preempt_timeout_is_named(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match=rf"preempt_timeout .* got {bad!r}"):
        TaskpointTrainerCallback(Checkpoint(f"file://{tmp_path}"), preempt_timeout=bad)  # type: ignore[arg-type]


@pytest.mark.slow
def test_sigterm_during_an_upload_ends_the_attempt_after_it(tmp_path: Path) -> None:
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"
    marker = tmp_path / "uploading"
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "TASKPOINT_ACTION": "hf-sigterm", "TASKPOINT_ROOT": str(tmp_path / "runtime"),
        # The environment contract now saves on SIGTERM by default; this test is about the
        # upload already in flight, so no preemption save is made after it.
        "TASKPOINT_SAVE_ON_PREEMPTION": "0",
    }
    command = [
        sys.executable, str(CHILD), "--store", store, "--work", str(work), "--recipes",
        "classifier", "--slow-upload", f"{marker}:6", "--set", "max_steps=24",
    ]
    # Its output goes to a file: a pipe nobody reads while the test waits for the marker
    # would stop the child once full.
    errors = tmp_path / "stderr.txt"
    # Steps from 6 on take 2 s: the signal reaches the process before step 9, the next
    # save, however late a loaded machine starts checkpoint-6's upload (CI once saw
    # checkpoint-9 commit, the signal having come at step 8).
    with errors.open("w") as sink:
        child = subprocess.Popen(
            [*command, "--pause", "6:2"], env=env, stdout=subprocess.DEVNULL, stderr=sink
        )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert child.poll() is None, errors.read_text()[-3000:]
            assert time.monotonic() < deadline, "checkpoint-6's upload never started"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        child.wait(timeout=300)
    finally:
        child.kill()
    waited = time.monotonic() - signalled
    stderr = errors.read_text()
    assert child.returncode == 1, stderr[-3000:]
    assert "Preempted" in stderr
    # the upload stalls 6 s from the marker; the signal follows it within a poll (50 ms)
    # or, on a loaded machine, a little later: 3 s of margin
    assert waited >= 3.0, "the attempt ended before the upload it had in flight"
    restored = Checkpoint(f"{store}/classifier").load_sync()
    assert restored is not None
    assert last_complete_checkpoint(restored) == restored / "checkpoint-6"

    resumed = subprocess.run(
        [*command[:-4], "--set", "max_steps=24"], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"classifier resumed from {work / 'classifier' / 'checkpoint-6'}" in resumed.stdout

"""Background mirrors: training goes on while the store is written; the cost is logged.

Uploads are made slow on purpose with a real ``taskpoint.Checkpoint`` whose ``progress=``
callback (called as payload bytes stream) holds them while a gate is closed.
"""

from __future__ import annotations

import csv
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
import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from lightning.pytorch.loggers import CSVLogger
from taskpoint.checkpoint import _uploader
from taskpoint.checkpoint.mirror import unshare
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")

SCRIPT = Path(__file__).with_name("train_script.py")


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


class At(L.Callback):
    """Calls ``actions["<hook>_<global step>"]()`` at ``batch_end`` or ``batch_start`` and
    keeps what it returned in ``seen``. Lightning runs it before any ModelCheckpoint."""

    def __init__(self, **actions: Callable[[], Any]) -> None:
        self.actions = actions
        self.seen: dict[str, Any] = {}

    def _at(self, hook: str, trainer: L.Trainer) -> None:
        key = f"{hook}_{trainer.global_step}"
        if key in self.actions:
            self.seen[key] = self.actions[key]()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._at("batch_end", trainer)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._at("batch_start", trainer)


def fit(mc: TaskpointModelCheckpoint, tmp_path: Path, *callbacks: L.Callback, **kwargs: Any) -> None:
    L.seed_everything(0)
    logger = CSVLogger(tmp_path / "logs", name="", version="")
    lib.trainer([*callbacks, mc], logger=logger, default_root_dir=tmp_path, **kwargs).fit(
        lib.TinyModule(), lib.loader("shuffle")
    )


def figures(tmp_path: Path) -> list[dict[str, float]]:
    """The rows of the run's metrics.csv that carry taskpoint's figures."""
    with (tmp_path / "logs" / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    return [
        {k: float(v) for k, v in row.items() if k.startswith("taskpoint/") and v}
        for row in rows
        if row.get("taskpoint/blocked_s")
    ]


@pytest.mark.parametrize("when_busy", ["coalesce", "wait"])
def test_a_mirror_during_an_upload_waits_behind_it_then_both_commit_in_order(
    tmp_path: Path, when_busy: str
) -> None:
    gate = Gate()
    # Format 1: one payload per save, so the figures can be checked against its file.
    checkpoint = taskpoint.Checkpoint(
        f"file://{tmp_path / 'store'}", keep=5, progress=gate, store_format=1,
        when_busy=when_busy,  # type: ignore[arg-type]
    )
    commits: list[taskpoint.SaveStats] = []
    checkpoint.on_commit(commits.append)

    def committed() -> int:
        return len(checkpoint.committed())

    def held() -> int:
        # step 2's upload is under way (a loaded machine may start it after training ends;
        # under "coalesce" the end's wait would then stop it for step 4's, as it should)
        assert gate.held.wait(timeout=30)
        return committed()

    def open_soon() -> int:
        gate.open_in(3.0)
        return committed()

    at = At(batch_end_2=gate.close, batch_end_3=held, batch_end_4=open_soon)
    mc = TaskpointModelCheckpoint(
        checkpoint, dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True
    )
    fit(mc, tmp_path, at, max_steps=4)

    # Step 3 trained while step 2's mirror was held at the gate, and step 4's mirror
    # waited behind it (or, with when_busy="wait", for it): both committed, in order.
    assert gate.held.is_set()
    assert at.seen == {"batch_end_2": None, "batch_end_3": 0, "batch_end_4": 0}
    assert [(s.attempt, s.seq) for s in commits] == [(0, 0), (0, 1)]
    resumed = resume_ckpt_path(checkpoint)
    assert resumed is not None
    assert torch.load(resumed, weights_only=False)["global_step"] == 4

    first, second = figures(tmp_path)
    assert 0 <= first["taskpoint/blocked_s"] < first["taskpoint/upload_s"]
    assert first["taskpoint/upload_s"] >= 0.5  # held at the gate
    assert first["taskpoint/uploaded_bytes"] == first["taskpoint/stored_bytes"] == commits[0].size
    payload = next((tmp_path / "store" / "checkpoints").glob("000000-000000000-*.payload"))
    assert payload.stat().st_size == commits[0].size
    if when_busy == "wait":
        assert second["taskpoint/blocked_s"] >= 2.0  # it waited for the first upload
    else:
        assert second["taskpoint/blocked_s"] < 1.5  # it never waited for the first upload
    assert second["taskpoint/stored_bytes"] == commits[1].size


def test_a_file_written_again_leaves_the_snapshots_link_intact(tmp_path: Path) -> None:
    """Lightning writes last.ckpt again at every save, with torch.save, which rewrites an
    existing file in place; a snapshot still uploading holds a hard link to it."""
    last = tmp_path / "last.ckpt"
    torch.save({"global_step": 1}, last)
    snapshot = tmp_path / "snapshot-last.ckpt"
    os.link(last, snapshot)
    assert unshare(last, copy=False) == 1  # how the callback calls it
    torch.save({"global_step": 2}, last)
    assert torch.load(snapshot)["global_step"] == 1
    assert torch.load(last)["global_step"] == 2
    assert unshare(last, copy=False) == unshare(tmp_path / "missing.ckpt") == 0


@pytest.mark.parametrize(("max_steps", "where"), [(6, "next mirror"), (4, "train end")])
def test_a_failed_upload_is_raised_and_the_previous_mirror_still_loads(
    tmp_path: Path, max_steps: int, where: str
) -> None:
    parent = tmp_path / "parent"
    checkpoint = taskpoint.Checkpoint(f"file://{parent / 'store'}", keep=5)
    mc = TaskpointModelCheckpoint(
        checkpoint, dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True
    )

    def break_store() -> None:
        mc.wait()  # step 2's mirror is committed
        parent.rename(tmp_path / "parent.moved")
        parent.write_text("a file where the store's folder was")

    at = At(batch_end_3=break_store)
    with pytest.raises(taskpoint.CheckpointStoreError, match="Not a directory"):
        fit(mc, tmp_path, at, max_steps=max_steps)

    parent.unlink()
    (tmp_path / "parent.moved").rename(parent)
    resumed = resume_ckpt_path(taskpoint.Checkpoint(f"file://{parent / 'store'}"))
    assert resumed is not None
    assert torch.load(resumed, weights_only=False)["global_step"] == 2


def test_an_upload_to_a_stopped_server_is_raised_at_the_next_mirror(
    seaweed_server: Any, tmp_path: Path
) -> None:
    """The default upload process, on SeaweedFS behind a proxy that goes down like a dead
    server after step 2's mirror committed: step 4's upload fails in the upload process,
    the mirror at step 6 raises it, and once the server is back step 2's mirror still loads."""
    url = seaweed_server.url("taskpoint-tests", uuid.uuid4().hex)
    with _servers.FaultProxy(seaweed_server) as proxy:
        options = proxy.storage_options()
        retry = taskpoint.RetryPolicy(attempts=2, initial=0.1, maximum=0.2)
        checkpoint = taskpoint.Checkpoint(url, keep=5, storage_options=options, retry=retry)
        assert _uploader.shared().wait_ready(60)  # so the uploads below run there
        mc = TaskpointModelCheckpoint(
            checkpoint, dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True
        )

        def stop_server() -> None:
            mc.wait()  # step 2's mirror is committed
            proxy.down()

        at = At(batch_end_3=stop_server, batch_start_5=lambda: mc._job.uploads.uploading)
        with pytest.raises(taskpoint.CheckpointStoreError):
            fit(mc, tmp_path, at, max_steps=6)
        assert at.seen["batch_start_5"]  # step 4's mirror had started; step 6's raised it
        assert checkpoint._saves.process_uploads > 0  # they ran in the upload process

        proxy.up()
        resumed = resume_ckpt_path(taskpoint.Checkpoint(url, storage_options=options))
        assert resumed is not None
        assert torch.load(resumed, weights_only=False)["global_step"] == 2


def test_another_checkpoint_type_mirrors_from_the_adapters_thread(tmp_path: Path) -> None:
    ckpt = lib.RecordingCheckpoint(taskpoint.Checkpoint(f"file://{tmp_path / 'store'}"))
    threads: list[str] = []
    inner = ckpt.save_sync

    def recording(data: Any, /) -> None:
        threads.append(threading.current_thread().name)
        assert Path(data).name == "ckpts" and Path(data) != tmp_path / "ckpts"  # a snapshot
        inner(data)

    ckpt.save_sync = recording  # type: ignore[method-assign]
    mc = TaskpointModelCheckpoint(  # background on another checkpoint type only when asked
        ckpt, dirpath=tmp_path / "ckpts", every_n_train_steps=2, blocking=False
    )
    fit(mc, tmp_path, max_steps=6)
    # A mirror asked for while one uploads (a loaded machine) waits behind it and may be
    # replaced by the next: every one is uploaded or counted as coalesced.
    assert 2 <= len(threads) <= 3 and set(threads) == {"taskpoint-mirror-upload"}
    rows = figures(tmp_path)
    assert len(rows) == len(threads)
    assert len(rows) + sum(row.get("taskpoint/coalesced", 0) for row in rows) == 3
    for row in rows:  # no on_commit: the adapter's own timings, no byte counts
        assert set(row) - {"taskpoint/coalesced"} == {"taskpoint/blocked_s", "taskpoint/upload_s"}


def test_blocking_keeps_the_synchronous_mirror(tmp_path: Path) -> None:
    checkpoint = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", keep=10)

    def committed() -> int:
        return len(checkpoint.committed())

    at = At(batch_start_2=committed, batch_start_4=committed)
    mc = TaskpointModelCheckpoint(
        checkpoint, dirpath=tmp_path / "ckpts", every_n_train_steps=2, blocking=True
    )
    fit(mc, tmp_path, at, max_steps=6)
    assert at.seen == {"batch_start_2": 1, "batch_start_4": 2}  # committed in the hook
    rows = figures(tmp_path)
    assert len(rows) == 3
    for row in rows:
        assert row["taskpoint/blocked_s"] >= row["taskpoint/upload_s"] > 0


@pytest.mark.parametrize("bad", [-1, True, "60"])
def test_bad_preempt_timeout_is_named(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match=rf"TaskpointModelCheckpoint: preempt_timeout .* got {bad!r}"):
        TaskpointModelCheckpoint(
            taskpoint.Checkpoint(f"file://{tmp_path}"), dirpath=tmp_path, preempt_timeout=bad
        )


def started(stdout: str) -> tuple[int, int]:
    line = next(x for x in stdout.splitlines() if x.startswith("STARTED "))
    epoch, step = line.split()[1:3]
    return int(epoch), int(step)


@pytest.mark.slow
def test_sigterm_during_an_upload_ends_the_run_after_it(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    out = tmp_path / "final.pt"
    marker = tmp_path / "uploading"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # 200 steps: training, which no longer waits for an upload, must still be going when the
    # signal lands (25 steps could end within the stall on a loaded machine, and a SIGTERM
    # after the last batch lets Lightning finish the fit).
    command = [
        sys.executable, str(SCRIPT), store, str(tmp_path), str(out), "--mode", "step",
        "--max-epochs", "40",
    ]
    # Mirrors every 3 steps; the second mirror's upload (step 6) stalls for 3 s.
    child = subprocess.Popen(
        [*command, "--slow-upload", f"{marker}:3"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the second mirror never started uploading"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        stdout, stderr = child.communicate(timeout=120)
    finally:
        child.kill()
    # Lightning stops at the end of the batch (SIGTERMException); the run ends only
    # once the upload in flight has committed.
    assert time.monotonic() - signalled >= 2.0, stderr[-3000:]
    assert not out.exists() and "STARTED" not in stdout
    restored = taskpoint.Checkpoint(store).load_sync()
    assert restored is not None
    newest = torch.load(restored / "last.ckpt", weights_only=False)["global_step"]
    # Step 6's upload, then the newest mirror asked for before the stop: training no
    # longer waits for an upload, so it may have gone on past step 9 meanwhile.
    assert newest >= 6 and newest % 3 == 0

    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert started(resumed.stdout) == (newest // 5, newest)  # five batches per epoch

"""The stop a preemption notice asks for, in this process: the notice is set the way a rank
that was not signalled gets it (``preemption.relay``), so no signal reaches pytest. The
real SIGTERMs, in processes of their own, are in ``test_preemption.py``."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from taskpoint import preemption
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")


@pytest.fixture(autouse=True)
def _no_notice() -> Iterator[None]:
    handler = signal.getsignal(signal.SIGTERM)
    preemption.reset()
    yield
    preemption.reset()
    signal.signal(signal.SIGTERM, handler)


class NoticeAt(L.Callback):
    """Sets the preemption notice as the batch after ``step`` starts (``remaining``
    seconds before the deadline), calling ``first`` first; records the SIGTERM handler
    training runs with."""

    def __init__(
        self, step: int, remaining: float = 60.0, first: Callable[[], object] | None = None
    ) -> None:
        self.step, self.remaining, self.first = step, remaining, first
        self.handler: Any = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.handler = signal.getsignal(signal.SIGTERM)
        if trainer.global_step == self.step:
            if self.first is not None:
                self.first()
            preemption.relay(self.remaining)


class WaitAt(L.Callback):
    """Calls ``wait`` as the batch after ``step`` starts."""

    def __init__(self, step: int, wait: Callable[[], object]) -> None:
        self.step, self.wait = step, wait

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            self.wait()


def fit(
    mc: TaskpointModelCheckpoint, tmp_path: Path, *extra: L.Callback,
    ckpt_path: str | None = None,
) -> lib.TinyModule:
    L.seed_everything(0)
    model = lib.TinyModule()
    trainer = lib.trainer([*extra, mc], default_root_dir=tmp_path)
    trainer.fit(model, lib.loader("resumable"), ckpt_path=ckpt_path)
    return model


def reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    model = lib.TinyModule()
    lib.trainer([], enable_checkpointing=False, default_root_dir=tmp_path / "reference").fit(
        model, lib.loader("resumable")
    )
    return lib.weights(model)


def callback(ckpt: taskpoint.Checkpoint, tmp_path: Path, **options: Any) -> TaskpointModelCheckpoint:
    return TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_on_preemption=True,
        **options,
    )


@pytest.mark.parametrize("save_last", [True, "link", None])
def test_a_notice_saves_at_the_next_step_and_the_next_fit_resumes_there_exactly(
    tmp_path: Path, save_last: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    notice = NoticeAt(7)
    with pytest.raises(taskpoint.Preempted, match=r"stopped at step 8 .*committed"):
        fit(callback(ckpt, tmp_path, save_last=save_last), tmp_path, notice)
    assert notice.handler is preemption._handle  # Lightning's own set aside while training
    assert "SIGTERM received: stopped at step 8" in caplog.text

    newest = ckpt.committed()[0]
    assert (newest.step, newest.preemption) == (8, True)
    restored = ckpt.load_sync()
    assert restored is not None and not (restored / "last.ckpt").is_symlink()
    assert torch.load(restored / "last.ckpt", weights_only=False)["global_step"] == 8

    preemption.reset()
    mc = callback(ckpt, tmp_path, save_last=save_last)
    path = resume_ckpt_path(ckpt, dirpath=tmp_path / "ckpts")
    assert path is not None and Path(path).name == "last.ckpt"
    model = fit(mc, tmp_path, ckpt_path=path)
    assert model.started_at == (1, 8)
    lib.assert_bitwise_equal(lib.weights(model), reference(tmp_path))
    final = ckpt.load_sync()
    assert final is not None
    # Without save_last, the next save superseded the preemption's last.ckpt: gone.
    assert (final / "last.ckpt").exists() == bool(save_last)


def test_a_save_at_the_stop_step_is_the_preemption_save(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", keep=5)
    mc = callback(ckpt, tmp_path, save_last=True)
    with pytest.raises(taskpoint.Preempted, match=r"stopped at step 6 .*the save at this step"):
        fit(mc, tmp_path, NoticeAt(5))  # every 3 steps: step 6 saved by ModelCheckpoint
    committed = [(m.step, m.preemption) for m in ckpt.committed()]
    assert committed[0] == (6, True)
    # The save at step 3 too, unless it was still uploading: the preemption save went first.
    assert committed[1:] in ([], [(3, False)])


class SlowUploads:
    """A ``progress=`` callback: every upload after the first commit stalls ``seconds``."""

    def __init__(self, store: Path, seconds: float) -> None:
        self.store, self.seconds = store, seconds
        self._stalled_at = 0

    def __call__(self, moved: int) -> None:
        commits = len(list((self.store / "checkpoints").glob("*.manifest.json")))
        if commits > self._stalled_at:
            self._stalled_at = commits
            time.sleep(self.seconds)


@pytest.mark.parametrize(
    ("step", "remaining", "outcome", "steps"),
    [
        (6, 60.0, "committed", [7, 6, 3]),
        (6, 3.0, "missed: the upload in flight did not finish in time", [6, 3]),
        # step 6's upload done: its 2.5 s are the estimate, which 3 - 1 s cannot hold
        (7, 3.0, "missed: a save takes about 2.", [6, 3]),
    ],
)
def test_the_upload_in_flight_is_finished_first_and_a_save_that_cannot_fit_is_skipped(
    tmp_path: Path, step: int, remaining: float, outcome: str, steps: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = tmp_path / "store"
    # Uploads after the first take 2.5 s: the one of step 6 is in flight at step 6's notice.
    ckpt = taskpoint.Checkpoint(f"file://{store}", progress=SlowUploads(store, 2.5), keep=5)
    mc = callback(ckpt, tmp_path, save_last=True)
    notice = NoticeAt(step, remaining, first=mc.wait if step == 7 else None)
    # Step 3's upload has committed before step 6's starts (on a loaded machine it could
    # still run, and step 6's save would wait behind it, then be replaced by the stop's).
    with pytest.raises(taskpoint.Preempted, match=outcome):
        fit(mc, tmp_path, WaitAt(5, mc.wait), notice)
    assert "SIGTERM received" in caplog.text
    mc.wait()
    assert [m.step for m in ckpt.committed()] == steps
    assert any(m.preemption for m in ckpt.committed()) == (outcome == "committed")


def test_a_notice_too_late_for_any_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", keep=5)
    mc = callback(ckpt, tmp_path, save_last=True)
    with pytest.raises(taskpoint.Preempted, match="missed"):
        fit(mc, tmp_path, NoticeAt(4, remaining=0.5))
    mc.wait()  # step 3's upload, if still in flight, commits all the same
    assert [m.step for m in ckpt.committed()] == [3]


def test_without_save_on_preemption_a_notice_changes_nothing(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", every_n_epochs=1)
    fit(mc, tmp_path, NoticeAt(4))
    assert [m.step for m in ckpt.committed()][:1] == [25]


def test_an_on_exception_checkpoint_in_dirpath_is_mirrored_and_its_removal_too(
    tmp_path: Path,
) -> None:
    """Lightning's OnExceptionCheckpoint saves with trainer.save_checkpoint, which no
    ModelCheckpoint method sees, and runs after this callback when listed after it."""
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    dirpath = tmp_path / "ckpts"

    def run(fail_at: set[int], ckpt_path: str | None = None) -> None:
        L.seed_everything(0)
        mc = TaskpointModelCheckpoint(ckpt, dirpath=dirpath, every_n_train_steps=3)
        trainer = lib.trainer(
            [mc, OnExceptionCheckpoint(dirpath)], default_root_dir=tmp_path
        )
        trainer.fit(lib.TinyModule(fail_at=fail_at), lib.loader("resumable"), ckpt_path=ckpt_path)

    with pytest.raises(lib.Planned):
        run({4})
    restored = ckpt.load_sync()
    assert restored is not None
    assert torch.load(restored / "on_exception.ckpt", weights_only=False)["global_step"] == 4

    # A run that ends well: OnExceptionCheckpoint deletes its file, and so does the store.
    run(set(), ckpt_path=resume_ckpt_path(ckpt, dirpath=dirpath))
    final = ckpt.load_sync()
    assert final is not None and not (final / "on_exception.ckpt").exists()


def test_an_on_exception_checkpoint_outside_dirpath_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", every_n_epochs=1)
    trainer = lib.trainer([OnExceptionCheckpoint(tmp_path / "elsewhere"), mc], max_epochs=1)
    trainer.fit(lib.TinyModule(), lib.loader("resumable"))
    assert "outside" in caplog.text and "not mirrored" in caplog.text

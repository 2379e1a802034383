"""What the store holds: every file Lightning finished writing, nothing it deleted, no
partially written file, and only after saves."""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path
from taskpoint_lightning._mirror import flush_async_io, unfinished_files

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")


def fit(mc: ModelCheckpoint, tmp_path: Path, max_epochs: int = 2, **kwargs: Any) -> L.LightningModule:
    L.seed_everything(0)
    model = lib.TinyModule(fail_at=kwargs.pop("fail_at", None))
    lib.trainer([mc], max_epochs=max_epochs, default_root_dir=tmp_path, **kwargs).fit(
        model, lib.loader("shuffle")
    )
    return model


def test_async_io_mirror_never_holds_a_partial_ckpt(tmp_path: Path) -> None:
    ckpt = lib.VerifyingCheckpoint(taskpoint.Checkpoint(f"file://{tmp_path / 'store'}"))
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_last=True
    )
    fit(mc, tmp_path, plugins=[AsyncCheckpointIO(lib.SlowCheckpointIO(pause=0.2))])

    assert len(ckpt.mirrors) == 5  # steps 2, 4, 6, 8, 10
    for local, stored, unreadable in ckpt.mirrors:
        assert unreadable == []
        assert stored == local  # the whole folder, as Lightning left it
        assert "last.ckpt" in stored
    resumed = resume_ckpt_path(ckpt)
    assert resumed is not None
    assert torch.load(resumed, weights_only=False)["global_step"] == 10


class NaiveMirror(ModelCheckpoint):
    """The spec's callback: mirrors in on_train_epoch_end, right after Lightning's save."""

    def __init__(self, checkpoint: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.checkpoint.save_sync(Path(self.dirpath))


def test_the_async_io_check_catches_a_naive_mirror(tmp_path: Path) -> None:
    """The test above can fail: mirroring as soon as the hook returns stores partial files."""
    ckpt = lib.VerifyingCheckpoint(taskpoint.Checkpoint(f"file://{tmp_path / 'store'}"))
    (tmp_path / "ckpts").mkdir()
    mc = NaiveMirror(ckpt, dirpath=tmp_path / "ckpts", every_n_epochs=1, save_last=True)
    fit(mc, tmp_path, plugins=[AsyncCheckpointIO(lib.SlowCheckpointIO(pause=0.3))])
    assert ckpt.mirrors
    assert any(
        unreadable or not any(name.endswith(".ckpt") for name in stored)
        for _, stored, unreadable in ckpt.mirrors
    )


def test_mirror_follows_topk_pruning(tmp_path: Path, store_url: str) -> None:
    ckpt = lib.VerifyingCheckpoint(taskpoint.Checkpoint(store_url))
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", monitor="train_loss", save_top_k=2,
        every_n_train_steps=1, save_last=True,
    )
    fit(mc, tmp_path)

    assert len(ckpt.mirrors) == 10
    for local, stored, unreadable in ckpt.mirrors:
        assert stored == local
        assert unreadable == []
        assert len(stored) <= 3  # two best and last.ckpt: pruned files are gone
    final = {p.name for p in (tmp_path / "ckpts").iterdir()}
    assert set(ckpt.mirrors[-1][1]) == final
    assert {Path(p).name for p in mc.best_k_models} | {"last.ckpt"} == final


def test_save_last_link_is_stored_as_a_link(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_last="link"
    )
    fit(mc, tmp_path)

    restored = ckpt.load_sync()
    assert restored is not None
    link = restored / "last.ckpt"
    assert link.is_symlink()
    target = link.resolve()
    assert target.parent == restored.resolve() and target.name == Path(mc.best_model_path).name
    resumed = resume_ckpt_path(ckpt)
    assert resumed is not None and Path(resumed).name == "last.ckpt"
    assert torch.load(resumed, weights_only=False)["global_step"] == 9


@pytest.mark.parametrize(
    ("options", "mirrors"),
    [
        ({"every_n_epochs": 2}, 2),  # after epochs 1 and 3 of 5
        # steps 3, 6, 9, 12 and 15; Lightning re-links last.ckpt, unchanged, at epoch ends
        ({"every_n_train_steps": 3, "save_last": "link"}, 5),
    ],
)
def test_mirrors_only_when_lightning_changed_the_folder(
    tmp_path: Path, options: dict[str, Any], mirrors: int
) -> None:
    ckpt = lib.RecordingCheckpoint(taskpoint.Checkpoint(f"file://{tmp_path / 'store'}"))
    mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", **options)
    fit(mc, tmp_path, max_epochs=3 if "every_n_train_steps" in options else 5)
    assert len(ckpt.saves) == mirrors


@pytest.mark.skipif(
    "save_on_exception" not in inspect.signature(ModelCheckpoint).parameters,
    reason="this Lightning has no ModelCheckpoint(save_on_exception=...)",
)
def test_checkpoint_saved_on_exception_is_mirrored(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", every_n_epochs=1, save_on_exception=True
    )
    with pytest.raises(lib.Planned):
        fit(mc, tmp_path, fail_at={7})
    restored = ckpt.load_sync()
    assert restored is not None
    steps = {torch.load(p, weights_only=False)["global_step"] for p in restored.glob("*.ckpt")}
    assert 7 in steps


def test_flush_async_io_waits_for_queued_writes(tmp_path: Path) -> None:
    io = AsyncCheckpointIO(lib.SlowCheckpointIO(pause=0.3))
    target = tmp_path / "x.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, target)
    assert unfinished_files(tmp_path, [target])  # still being written
    assert flush_async_io(io) == 1
    assert unfinished_files(tmp_path, [target]) == []
    assert torch.equal(torch.load(target)["w"], torch.ones(3))
    io.save_checkpoint({"w": torch.zeros(3)}, target)  # usable again after the flush
    io.teardown()
    assert torch.equal(torch.load(target)["w"], torch.zeros(3))


def test_unfinished_files_reports_truncated_empty_and_dangling(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(100)}, tmp_path / "good.ckpt")
    data = (tmp_path / "good.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "dangling.ckpt").symlink_to("missing.ckpt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    problems = unfinished_files(tmp_path, [tmp_path / "good.ckpt", tmp_path / "gone.ckpt"])
    assert len(problems) == 4
    for name in ("cut.ckpt", "empty.ckpt", "dangling.ckpt", "gone.ckpt"):
        assert any(name in p for p in problems), name
    assert not any("good.ckpt (" in p for p in problems)


def test_unfinished_files_skips_staged_parts_even_as_they_vanish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job mirror stages each rank's part in a ``.taskpoint-part-*`` folder inside the
    checkpoint folder and removes it when the upload ends, which may be while rank 0 looks:
    the look neither reports the staged files nor fails on the folder going away."""
    torch.save({"w": torch.ones(3)}, tmp_path / "good.ckpt")
    staged = tmp_path / ".taskpoint-part-1-abc" / "ckpts"
    staged.mkdir(parents=True)
    (staged / "half.ckpt").write_bytes(b"PK\x03\x04 cut short")
    scandir = os.scandir

    def removed_first(path: Any) -> Any:  # the upload ends between listing and looking in
        if Path(path).name.startswith(".taskpoint-part-"):
            shutil.rmtree(path)
        return scandir(path)

    assert unfinished_files(tmp_path) == []
    monkeypatch.setattr(os, "scandir", removed_first)
    assert unfinished_files(tmp_path, [tmp_path / "good.ckpt"]) == []


def test_remote_dirpath_is_refused(tmp_path: Path) -> None:
    mc = TaskpointModelCheckpoint(
        taskpoint.Checkpoint(f"file://{tmp_path / 'store'}"), dirpath="memory://ckpts"
    )
    with pytest.raises(ValueError, match=r"dirpath='memory://ckpts' is remote"):
        fit(mc, tmp_path, max_epochs=1)


@pytest.mark.parametrize("bad", [None, "file:///tmp/x", object()])
def test_checkpoint_argument_is_checked(bad: object) -> None:
    with pytest.raises(TypeError, match="CheckpointLike"):
        TaskpointModelCheckpoint(bad)  # type: ignore[arg-type]


class BrokenStore(lib.RecordingCheckpoint):
    def save_sync(self, data: Any, /) -> None:
        super()._record(data)
        raise taskpoint.CheckpointStoreError("store is down", url="test://down")


@pytest.mark.skipif(
    "save_on_exception" not in inspect.signature(ModelCheckpoint).parameters,
    reason="this Lightning has no ModelCheckpoint(save_on_exception=...)",
)
def test_a_failed_mirror_on_exception_keeps_the_training_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = BrokenStore(taskpoint.Checkpoint(f"file://{tmp_path / 'store'}"))
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=tmp_path / "ckpts", every_n_epochs=1, save_on_exception=True
    )
    with pytest.raises(lib.Planned):
        fit(mc, tmp_path, fail_at={2})
    assert len(ckpt.saves) == 1
    assert "could not mirror" in caplog.text and "store is down" in caplog.text

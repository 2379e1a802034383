"""``resume_ckpt_path``: which file it picks, and how it restores into ``dirpath``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from taskpoint import TaskpointWarning
from taskpoint_lightning import RNG_STATE_KEY, TaskpointModelCheckpoint, resume_ckpt_path

PICKS = pytest.mark.stores("file", "s3")
"""For which file is picked, decided from the restored tree's names and times, the same
whatever the store: the file store and one object store are enough. An empty store and the
restore into ``dirpath`` run on every store."""


def make_tree(root: Path, files: dict[str, int]) -> Path:
    """Files named by ``files``, each with that modification time."""
    root.mkdir(parents=True)
    for name, mtime in files.items():
        path = root / name
        path.write_bytes(name.encode())
        os.utime(path, (mtime, mtime))
    return root


def test_none_before_any_mirror(store_url: str, tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(store_url)
    assert resume_ckpt_path(ckpt) is None
    assert resume_ckpt_path(ckpt, dirpath=tmp_path / "ckpts") is None
    assert not (tmp_path / "ckpts").exists()


def test_a_timeout_that_is_not_a_positive_number_is_refused(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    for bad in (0, -1.0, True, "60"):
        with pytest.raises(ValueError, match="timeout"):
            resume_ckpt_path(ckpt, timeout=bad)  # type: ignore[arg-type]


@PICKS
def test_prefers_newest_last_then_newest_ckpt(store_url: str, tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(store_url)
    ckpt.save_sync(make_tree(tmp_path / "a" / "ckpts", {
        "last.ckpt": 100, "last-v1.ckpt": 200, "epoch=9.ckpt": 300, "notes.txt": 400,
    }))
    path = resume_ckpt_path(ckpt)
    assert path is not None and Path(path).name == "last-v1.ckpt"

    ckpt.save_sync(make_tree(tmp_path / "b" / "ckpts", {
        "epoch=1.ckpt": 100, "epoch=3.ckpt": 300, "epoch=2.ckpt": 200,
    }))
    path = resume_ckpt_path(ckpt)
    assert path is not None and Path(path).name == "epoch=3.ckpt"


@PICKS
def test_a_sharded_checkpoint_folder_counts_dated_by_its_newest_file(
    store_url: str, tmp_path: Path
) -> None:
    # FSDPStrategy(state_dict_type="sharded") writes each .ckpt as a folder of shard files
    root = make_tree(tmp_path / "ckpts", {"epoch=1.ckpt": 100})
    make_tree(root / "last.ckpt", {".metadata": 150, "__0_0.distcp": 50, "__1_0.distcp": 50})
    make_tree(root / "epoch=3.ckpt", {".metadata": 300, "__0_0.distcp": 300})
    (root / "epoch=4.ckpt").mkdir()  # an empty folder is no checkpoint
    ckpt = taskpoint.Checkpoint(store_url)
    ckpt.save_sync(root)
    path = resume_ckpt_path(ckpt)
    assert path is not None and Path(path).name == "last.ckpt" and Path(path).is_dir()

    newer = make_tree(tmp_path / "b" / "ckpts", {"epoch=1.ckpt": 100})
    make_tree(newer / "epoch=2.ckpt", {".metadata": 200})
    ckpt.save_sync(newer)
    path = resume_ckpt_path(ckpt)
    assert path is not None and Path(path).name == "epoch=2.ckpt"


@PICKS
def test_no_ckpt_in_the_mirror_gives_none(store_url: str, tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(store_url)
    ckpt.save_sync(make_tree(tmp_path / "ckpts", {"notes.txt": 1}))
    assert resume_ckpt_path(ckpt) is None


def test_restores_into_dirpath_replacing_stale_files(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(name, raising=False)
    ckpt = taskpoint.Checkpoint(store_url)
    ckpt.save_sync(make_tree(tmp_path / "saved", {"last.ckpt": 100, "epoch=2.ckpt": 90}))
    dirpath = make_tree(tmp_path / "ckpts", {"epoch=3.ckpt": 500, "last.ckpt": 500})

    path = resume_ckpt_path(ckpt, dirpath=dirpath)

    assert path == os.fspath(dirpath / "last.ckpt")
    assert sorted(p.name for p in dirpath.iterdir()) == ["epoch=2.ckpt", "last.ckpt"]
    assert (dirpath / "last.ckpt").read_bytes() == b"last.ckpt"
    assert (dirpath / "last.ckpt").stat().st_mtime == 100


@PICKS
def test_other_ranks_leave_dirpath_alone(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    ckpt = taskpoint.Checkpoint(store_url)
    ckpt.save_sync(make_tree(tmp_path / "saved", {"last.ckpt": 100}))
    dirpath = make_tree(tmp_path / "ckpts", {"other.ckpt": 500})

    path = resume_ckpt_path(ckpt, dirpath=dirpath)

    assert path is not None and Path(path).name == "last.ckpt"
    assert not Path(path).is_relative_to(dirpath)
    assert [p.name for p in dirpath.iterdir()] == ["other.ckpt"]


@pytest.mark.filterwarnings("ignore::UserWarning:lightning")
def test_checkpoint_holds_random_state_in_weights_only_form(tmp_path: Path) -> None:
    """Lightning loads with torch.load's default, weights_only=True."""
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", save_last=True)
    lib.trainer([mc], max_epochs=1, default_root_dir=tmp_path).fit(
        lib.TinyModule(), lib.loader("shuffle")
    )
    loaded = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)
    state = loaded[RNG_STATE_KEY]
    assert RNG_STATE_KEY not in loaded["callbacks"][mc.state_key]
    assert state["format"] == 1 and state["mid_epoch"] is False
    (ranks,) = state["ranks"]
    assert set(ranks) >= {"torch", "python", "numpy"}


@pytest.mark.filterwarnings("ignore::UserWarning:lightning")
def test_resuming_a_checkpoint_without_random_state_warns(tmp_path: Path) -> None:
    plain = ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True)
    lib.trainer([plain], max_epochs=1, default_root_dir=tmp_path).fit(
        lib.TinyModule(), lib.loader("shuffle")
    )
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", save_last=True)
    with pytest.warns(TaskpointWarning, match="holds no random state"):
        lib.trainer([mc], max_epochs=2, default_root_dir=tmp_path).fit(
            lib.TinyModule(), lib.loader("shuffle"), ckpt_path=tmp_path / "plain" / "last.ckpt"
        )

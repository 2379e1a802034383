"""TaskpointTrainerCallback: when it uploads, what the upload holds, how it is configured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import taskpoint_hf_testkit as kit
from taskpoint import Checkpoint
from taskpoint_hf import (
    TRAINER_STATE,
    TaskpointTrainerCallback,
    last_complete_checkpoint,
)

FULL_MODEL_FILES = {TRAINER_STATE, "model.safetensors", "optimizer.pt", "rng_state.pth"}


@pytest.mark.parametrize(
    ("overrides", "saved_at"),
    [
        ({}, [3, 6, 9, 12]),
        ({"save_strategy": "epoch", "max_steps": -1, "num_train_epochs": 2}, [8, 16]),
    ],
    ids=["steps", "epoch"],
)
def test_each_upload_follows_a_complete_write_and_rotation(
    tmp_path: Path, overrides: dict[str, Any], saved_at: list[int]
) -> None:
    log = tmp_path / "saves.jsonl"
    checkpoint = kit.RecordingCheckpoint(Checkpoint(f"file://{tmp_path / 'store'}"), log)
    kit.run_classifier(checkpoint, tmp_path / "out", **overrides)

    saves = kit.read_saves(log)
    assert [entry["newest"] for entry in saves] == saved_at
    for entry in saves:
        newest = entry["checkpoints"][f"checkpoint-{entry['newest']}"]
        assert set(newest) >= FULL_MODEL_FILES  # written completely before the upload
        assert len(entry["checkpoints"]) <= 2  # save_total_limit=2 already applied

    restored = Checkpoint(f"file://{tmp_path / 'store'}").load_sync()
    assert restored is not None
    assert last_complete_checkpoint(restored) == restored / f"checkpoint-{saved_at[-1]}"


def test_output_dir_defaults_to_the_arguments(tmp_path: Path) -> None:
    checkpoint = Checkpoint(f"file://{tmp_path / 'store'}")
    callback = TaskpointTrainerCallback(checkpoint)
    assert callback.output_dir is None
    kit.run_classifier(None, tmp_path / "out", callbacks=[callback])
    assert callback.output_dir == tmp_path / "out"
    restored = checkpoint.load_sync()
    assert restored is not None and restored.name == "out"
    assert last_complete_checkpoint(restored) == restored / "checkpoint-12"


def test_a_different_output_dir_is_refused_before_training(tmp_path: Path) -> None:
    checkpoint = Checkpoint(f"file://{tmp_path / 'store'}")
    callback = TaskpointTrainerCallback(checkpoint, tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="pass the same directory"):
        kit.run_classifier(None, tmp_path / "out", callbacks=[callback])
    assert checkpoint.load_sync() is None


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="CheckpointLike"):
        TaskpointTrainerCallback(object(), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="output_dir must be"):
        TaskpointTrainerCallback(Checkpoint(f"file://{tmp_path}"), 3)  # type: ignore[arg-type]

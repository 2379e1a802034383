"""TaskpointTrainerCallback: when it uploads, what the upload holds, how it is configured."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import taskpoint_hf_testkit as kit
from taskpoint import Checkpoint
from taskpoint_hf import (
    TRAINER_STATE,
    TaskpointTrainerCallback,
    checkpoint_step,
    last_complete_checkpoint,
)
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

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


class _Sigterm(TrainerCallback):
    """Send this process SIGTERM at ``step``, then slow steps down so the Trainer's
    just-in-time checkpoint (armed a few seconds after the signal) lands mid-run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
        if state.global_step >= self.step:
            time.sleep(0.4)


def test_just_in_time_checkpoint_is_uploaded_at_train_end(tmp_path: Path) -> None:
    if "enable_jit_checkpoint" not in TrainingArguments.__dataclass_fields__:
        pytest.skip("this transformers has no just-in-time checkpoints")
    log = tmp_path / "saves.jsonl"
    checkpoint = kit.RecordingCheckpoint(Checkpoint(f"file://{tmp_path / 'store'}"), log)
    kit.run_classifier(  # no regular save within the 40 steps: only the JIT checkpoint
        checkpoint, tmp_path / "out", callbacks=[_Sigterm(7)], max_steps=40, save_steps=100,
        enable_jit_checkpoint=True,
    )
    written = last_complete_checkpoint(tmp_path / "out")
    assert written is not None
    step = checkpoint_step(written)
    assert step is not None and 7 <= step < 40  # the Trainer stopped early after writing it
    assert [entry["newest"] for entry in kit.read_saves(log)] == [step]
    restored = Checkpoint(f"file://{tmp_path / 'store'}").load_sync()
    assert restored is not None
    assert last_complete_checkpoint(restored) == restored / f"checkpoint-{step}"

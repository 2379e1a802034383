"""A checkpoint resumed with another LoRA config or base model is refused, naming the difference."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("unsloth", reason="Unsloth is not installed: run these tests with "
                    "`UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth "
                    "pytest integrations/unsloth/tests`")

import taskpoint
import unsloth_testkit as kit
from taskpoint_unsloth import (
    LORA_RECORD,
    LoraConfigMismatchError,
    check_lora_config,
    lora_signature,
    restore_lora_checkpoint,
)
from transformers import TrainerCallback


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, base_model: Path) -> str:
    """A store URL holding a 3-step run with LoRA r=4, alpha=8 on q_proj and v_proj."""
    root = tmp_path_factory.mktemp("trained")
    url = f"file://{root / 'store'}"
    kit.run_unsloth_sft(taskpoint.Checkpoint(url), root / "out", base_model, max_steps=3)
    return url


@pytest.fixture
def restored(tmp_path: Path, trained: str) -> Path:
    """The trained run's checkpoint-3, restored into a fresh directory."""
    tree = taskpoint.Checkpoint(trained).load_sync()
    assert tree is not None
    return Path(shutil.copytree(tree / "checkpoint-3", tmp_path / "checkpoint-3"))


class NeverTrain(TrainerCallback):
    def on_train_begin(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("training started despite the LoRA mismatch")


def test_different_rank_is_refused_before_training(
    tmp_path: Path, trained: str, base_model: Path
) -> None:
    ckpt = taskpoint.Checkpoint(trained)
    saves = len(ckpt.committed())
    with pytest.raises(LoraConfigMismatchError) as info:
        kit.run_unsloth_sft(ckpt, tmp_path / "out", base_model, r=8, callbacks=[NeverTrain()])
    message = str(info.value)
    assert "was trained with LoRA r=4, but the model has r=8" in message
    assert "checkpoint-3" in message
    assert info.value.mismatches == [("r", 4, 8)]
    assert isinstance(info.value, taskpoint.CheckpointError)
    assert len(ckpt.committed()) == saves  # nothing trained, nothing saved


def test_same_config_is_accepted(tmp_path: Path, trained: str, base_model: Path) -> None:
    model, _ = kit.load_lora_model(base_model)
    path = restore_lora_checkpoint(taskpoint.Checkpoint(trained), tmp_path / "out", model)
    assert path == tmp_path / "out" / "checkpoint-3"


def test_different_target_modules_and_alpha_are_named(restored: Path, base_model: Path) -> None:
    model, _ = kit.load_lora_model(
        base_model, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj")
    )
    with pytest.raises(LoraConfigMismatchError) as info:
        check_lora_config(restored, model)
    message = str(info.value)
    assert "lora_alpha=8, target_modules=['q_proj', 'v_proj']" in message
    assert "lora_alpha=16, target_modules=['k_proj', 'q_proj', 'v_proj']" in message
    assert [name for name, _, _ in info.value.mismatches] == ["lora_alpha", "target_modules"]


def test_different_base_model_is_named(
    tmp_path: Path, restored: Path, base_model: Path
) -> None:
    other = kit.make_base_model(tmp_path / "wider-llama", hidden_size=32)
    model, _ = kit.load_lora_model(other)
    with pytest.raises(LoraConfigMismatchError) as info:
        check_lora_config(restored, model)
    assert [name for name, _, _ in info.value.mismatches] == ["base_model", "base_config_hash"]
    assert f"base_model={str(base_model)!r}" in str(info.value)
    with pytest.raises(LoraConfigMismatchError, match="base_config_hash="):
        check_lora_config(restored, model, ignore=["base_model"])


def test_same_base_model_from_another_path_passes_with_ignore(
    tmp_path: Path, restored: Path, base_model: Path
) -> None:
    moved = Path(shutil.copytree(base_model, tmp_path / "copy-of-base"))
    model, _ = kit.load_lora_model(moved)
    with pytest.raises(LoraConfigMismatchError) as info:
        check_lora_config(restored, model)
    assert [name for name, _, _ in info.value.mismatches] == ["base_model"]
    assert check_lora_config(restored, model, ignore=["base_model"]) == lora_signature(model)


def test_without_record_peft_adapter_config_is_checked(restored: Path, base_model: Path) -> None:
    (restored / LORA_RECORD).unlink()
    model, _ = kit.load_lora_model(base_model, r=8)
    with pytest.raises(LoraConfigMismatchError, match="trained with LoRA r=4, but the model has r=8"):
        check_lora_config(restored, model)


def test_checkpoint_without_adapter_is_refused(tmp_path: Path, base_model: Path) -> None:
    folder = tmp_path / "checkpoint-7"
    folder.mkdir()
    model, _ = kit.load_lora_model(base_model)
    with pytest.raises(LoraConfigMismatchError, match="holds no LoRA adapter"):
        check_lora_config(folder, model)


def test_model_without_lora_is_a_type_error(restored: Path, base_model: Path) -> None:
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        str(base_model), max_seq_length=32, load_in_4bit=False, local_files_only=True
    )
    with pytest.raises(TypeError, match="get_peft_model"):
        check_lora_config(restored, model)


def test_unknown_ignore_field_is_a_type_error(restored: Path, base_model: Path) -> None:
    model, _ = kit.load_lora_model(base_model)
    with pytest.raises(TypeError, match="rank"):
        check_lora_config(restored, model, ignore=["rank"])

"""On CPU (Unsloth's CPU fallback): interrupted LoRA runs finish like uninterrupted ones."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("unsloth", reason="Unsloth is not installed: run these tests with "
                    "`UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth "
                    "pytest integrations/unsloth/tests`")

import taskpoint
import torch
import unsloth_testkit as kit
from safetensors import safe_open
from taskpoint_unsloth import LORA_RECORD, read_lora_record, restore_lora_checkpoint
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

CHILD = Path(__file__).with_name("unsloth_child.py")


def test_exception_then_retry_matches_uninterrupted_run(
    tmp_path: Path, base_model: Path, reference: Callable[..., kit.Result]
) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    with pytest.raises(kit.Interrupt, match="step 5"):
        kit.run_unsloth_sft(ckpt, tmp_path / "a1", base_model, stop=kit.StopAt(5))
    # The retry runs in a fresh output_dir, as on another machine.
    got = kit.run_unsloth_sft(ckpt, tmp_path / "a2", base_model)
    assert got.resumed_from == str(tmp_path / "a2" / "checkpoint-3")
    want = reference()
    assert want.global_step == got.global_step == 10
    kit.assert_same_run(got, want)


class FailBeforeStep(TrainerCallback):
    """Raise :class:`kit.Interrupt` as step ``step + 1`` begins (its batch fetched)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if state.global_step == self.step:
            raise kit.Interrupt(f"simulated failure as step {self.step + 1} began")


def test_an_exception_saves_the_last_step_with_its_lora_record_and_the_retry_resumes_there(
    tmp_path: Path, base_model: Path, reference: Callable[..., kit.Result]
) -> None:
    """``save_on_exception=True`` through the Unsloth callback: the failure after step 4
    writes checkpoint-4, with the LoRA record the callback adds to every save, and the
    retry resumes there (not at the save strategy's checkpoint-3)."""
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    options = {"save_on_exception": True}
    with pytest.raises(kit.Interrupt, match="step 5 began"):
        kit.run_unsloth_sft(ckpt, tmp_path / "a1", base_model, callbacks=[FailBeforeStep(4)],
                            callback_options=options)
    assert (tmp_path / "a1" / "checkpoint-4" / LORA_RECORD).is_file()
    got = kit.run_unsloth_sft(ckpt, tmp_path / "a2", base_model, callback_options=options)
    assert got.resumed_from == str(tmp_path / "a2" / "checkpoint-4")
    kit.assert_same_run(got, reference())


def test_killed_process_then_retry_matches_uninterrupted_run(
    tmp_path: Path, base_model: Path, reference: Callable[..., kit.Result]
) -> None:
    store = f"file://{tmp_path / 'store'}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def child(work: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(CHILD), "--store", store, "--base", str(base_model),
             "--work", str(tmp_path / work), *extra],
            capture_output=True, text=True, env=env, timeout=600, check=False,
        )

    killed = child("attempt-1", "--stop", "8")
    assert killed.returncode == kit.KILLED_EXIT, killed.stderr[-3000:]
    assert not (tmp_path / "attempt-1" / "result.pt").exists()
    retry = child("attempt-2")
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert f"resumed from {tmp_path / 'attempt-2' / 'out' / 'checkpoint-6'}" in retry.stdout
    got = kit.Result.from_dict(torch.load(tmp_path / "attempt-2" / "result.pt"))
    want = reference()
    assert got.global_step == want.global_step == 10
    kit.assert_same_run(got, want)


def test_checkpoint_holds_adapter_optimizer_scheduler_but_not_base_model(
    tmp_path: Path, base_model: Path
) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    kit.run_unsloth_sft(ckpt, tmp_path / "run", base_model, max_steps=3)
    restored = ckpt.load_sync()
    assert restored is not None
    saved = restored / "checkpoint-3"
    names = {p.name for p in saved.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt",
            "scheduler.pt", "trainer_state.json", "rng_state.pth", LORA_RECORD} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"}
    assert not list(restored.rglob("model*.safetensors"))
    with safe_open(str(saved / "adapter_model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys), keys
    # No base weights anywhere: every saved file is smaller than the base model's weights,
    # and the adapter file is a small fraction of them.
    base_bytes = (base_model / "model.safetensors").stat().st_size
    biggest = max(p.stat().st_size for p in restored.rglob("*") if p.is_file())
    assert biggest < base_bytes, (biggest, base_bytes)
    assert (saved / "adapter_model.safetensors").stat().st_size < base_bytes / 4
    record = read_lora_record(saved)
    assert record is not None
    assert (record.r, record.lora_alpha, record.target_modules) == (4, 8, kit.TARGETS)
    assert record.base_model == str(base_model)
    assert record.base_config_hash is not None


def test_first_attempt_starts_from_scratch(tmp_path: Path, base_model: Path) -> None:
    model, _ = kit.load_lora_model(base_model)
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    assert restore_lora_checkpoint(ckpt, tmp_path / "out", model) is None

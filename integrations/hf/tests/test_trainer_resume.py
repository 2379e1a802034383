"""Interrupted Trainer and SFTTrainer runs finish exactly like uninterrupted ones."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import taskpoint
import taskpoint_hf_testkit as kit
import torch
from taskpoint_hf import last_complete_checkpoint

CHILD = Path(__file__).with_name("taskpoint_hf_child.py")

CASES = {
    # recipe, TrainingArguments overrides, where attempt 0 fails, where attempt 1 resumes
    "trainer-steps": ("classifier", {}, kit.StopAt(7), 6),
    "trainer-epoch": (
        "classifier",
        {"save_strategy": "epoch", "max_steps": -1, "num_train_epochs": 3},
        kit.StopAt(13),
        8,
    ),
    # dies after checkpoint-6 is written locally but before it is uploaded
    "sft-lora": ("sft", {}, kit.StopAt(6, event="save"), 3),
}


@pytest.mark.parametrize("case", [
    # One recipe on every store; the others go through the same checkpoint calls, so the
    # file store and one object store are enough for them (each Trainer run costs seconds).
    case if case == "trainer-steps" else pytest.param(case, marks=pytest.mark.stores("file", "s3"))
    for case in CASES
])
def test_retry_after_exception_matches_uninterrupted_run(
    case: str, store_url: str, tmp_path: Path, reference: Callable[..., kit.Result]
) -> None:
    recipe, overrides, stop, resume_step = CASES[case]
    env = taskpoint.TaskEnvironment(name="hf", root=store_url)
    out = tmp_path / "out"  # the same output_dir for every attempt, as in one process
    attempts: list[tuple[int, str | None]] = []

    @env.task(retries=1, backoff=0.0)
    def train() -> kit.Result:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        try:
            result = kit.RECIPES[recipe](
                context.checkpoint, out, stop=stop if context.attempt == 0 else None, **overrides
            )
        except kit.Interrupt:
            attempts.append((context.attempt, None))
            raise
        attempts.append((context.attempt, result.resumed_from))
        return result

    result = train()
    assert attempts == [(0, None), (1, str(out / f"checkpoint-{resume_step}"))]
    kit.assert_same_run(result, reference(recipe, **overrides))
    if recipe == "sft":  # PEFT checkpoints hold the adapter, not the full model
        newest = last_complete_checkpoint(out)
        assert newest is not None
        names = {p.name for p in newest.iterdir()}
        assert "adapter_model.safetensors" in names and "model.safetensors" not in names


def _child(store: str, work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(CHILD), "--store", store, "--work", str(work), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def _load(path: Path) -> kit.Result:
    return kit.Result.from_dict(torch.load(path, weights_only=False))


@pytest.mark.slow
def test_killed_processes_resume_to_the_same_result(tmp_path: Path) -> None:
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"
    results = work / "results"
    recipes = ("--recipes", "classifier,sft")

    # Launch 1: uninterrupted references, then the Trainer run dies at step 7.
    first = _child(store, work, *recipes, "--reference", "--stop", "classifier:7:step_end")
    assert first.returncode == kit.KILLED_EXIT, first.stderr[-3000:]
    assert not (results / "classifier-rank0.pt").exists()

    # Launch 2: the Trainer run resumes and finishes; the SFTTrainer (LoRA) run dies right
    # after writing checkpoint-6, before the callback could upload it.
    second = _child(store, work, *recipes, "--stop", "sft:6:save")
    assert second.returncode == kit.KILLED_EXIT, second.stderr[-3000:]
    assert f"classifier resumed from {work / 'classifier' / 'checkpoint-6'}" in second.stdout
    assert (work / "sft" / "checkpoint-6" / "adapter_model.safetensors").exists()

    # Launch 3: the SFTTrainer run resumes from the last uploaded checkpoint and finishes.
    third = _child(store, work, *recipes)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"sft resumed from {work / 'sft' / 'checkpoint-3'}" in third.stdout

    for recipe in ("classifier", "sft"):
        result = _load(results / f"{recipe}-rank0.pt")
        kit.assert_same_run(result, _load(results / f"{recipe}-reference-rank0.pt"))
    uploads = [entry["newest"] for entry in kit.read_saves(work / "calls-rank0.jsonl")]
    assert uploads == [3, 6, 9, 12, 3, 6, 9, 10]

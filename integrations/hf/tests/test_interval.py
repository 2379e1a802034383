"""Saves by training time (``save_every_s``): seconds, ``"auto"`` or a
``taskpoint.SaveInterval``, with ``Trainer`` and TRL's ``SFTTrainer``, under ``torchrun``.

The clock is a fake one that advances at each step's start (``Tick``): no test sleeps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import taskpoint
import taskpoint_hf_testkit as kit
import torch
from taskpoint import SaveInterval
from taskpoint_hf import TaskpointTrainerCallback, checkpoint_step
from taskpoint_hf_interval_child import Clock, SavedSteps, Tick
from transformers import TrainerCallback

CHILD = Path(__file__).with_name("taskpoint_hf_interval_child.py")


def checkpoints(folder: Path) -> list[int]:
    """The steps of the ``checkpoint-N`` folders in ``folder``."""
    return sorted(s for s in map(checkpoint_step, folder.glob("checkpoint-*")) if s is not None)


def train(
    tmp_path: Path, save_every_s: Any, clock: Clock, step_s: float = 10.0, **overrides: Any
) -> tuple[TaskpointTrainerCallback, SavedSteps, taskpoint.Checkpoint]:
    """The classifier for 12 steps of ``step_s`` on ``clock``, saving by time (and
    ``overrides``)."""
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    if callable(save_every_s):
        save_every_s = save_every_s(ckpt)
    out = tmp_path / "out"
    callback = TaskpointTrainerCallback(ckpt, out, save_every_s=save_every_s)
    saves = SavedSteps()
    options: dict[str, Any] = {"save_strategy": "no", "save_total_limit": None, **overrides}
    trainer = kit.classifier_trainer(
        out, callbacks=[Tick(clock, step_s), saves, callback], **options
    )
    trainer.train()
    return callback, saves, ckpt


def test_saves_every_interval_of_training_time(tmp_path: Path) -> None:
    clock = Clock()
    callback, saves, ckpt = train(
        tmp_path, lambda ckpt: SaveInterval.for_checkpoint(ckpt, 25.0, clock=clock), clock
    )
    # 30 s after the start, then 30 s after each save (25 s reached within the next step).
    assert saves.steps == [3, 6, 9, 12]
    assert checkpoints(tmp_path / "out") == [3, 6, 9, 12]
    restored = ckpt.load_sync()
    assert restored is not None and checkpoints(restored) == [3, 6, 9, 12]
    assert callback.save_interval is not None
    assert callback.save_interval.interval_s == 25.0


def test_alongside_save_steps_and_restarted_by_every_save(tmp_path: Path) -> None:
    """``save_steps`` saves as before; a timed save comes 25 s after the last save,
    whichever made it."""
    clock = Clock()
    _, saves, _ = train(
        tmp_path, lambda ckpt: SaveInterval.for_checkpoint(ckpt, 25.0, clock=clock), clock,
        save_strategy="steps", save_steps=5, save_total_limit=2,
    )
    # Step 3 by time (30 s); 5, 10 and the last, 12, by save_steps; 8 by time (30 s
    # after step 5's save; not 6, 10 s after it).
    assert saves.steps == [3, 5, 8, 10, 12]


def test_sft_trainer_saves_by_time(tmp_path: Path) -> None:
    """TRL's SFTTrainer (LoRA on a tiny Llama) takes the same knob."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    clock = Clock()
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    out = tmp_path / "out"
    args = SFTConfig(
        output_dir=str(out), max_steps=10, per_device_train_batch_size=2, save_strategy="no",
        logging_steps=1, learning_rate=1e-2, report_to="none", seed=42, use_cpu=True,
        disable_tqdm=True, max_length=16, dataset_text_field="text",
    )
    tokenizer = kit.word_tokenizer(causal=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    saves = SavedSteps()
    callback = TaskpointTrainerCallback(
        ckpt, out, save_every_s=SaveInterval.for_checkpoint(ckpt, 25.0, clock=clock)
    )
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config), args=args,
        train_dataset=Dataset.from_dict({"text": kit.SENTENCES * 2}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               task_type="CAUSAL_LM"),
        callbacks=[Tick(clock), saves, callback],
    )
    trainer.train()
    assert saves.steps == [3, 6, 9]
    restored = ckpt.load_sync()
    assert restored is not None and checkpoints(restored) == [3, 6, 9]
    assert (restored / "checkpoint-9" / "adapter_model.safetensors").exists()


def test_auto_saves_more_often_after_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save_every_s="auto"`` reads the run's failures from the store: a run that failed
    often gets a shorter interval (and more saves) than a new one, which uses the prior."""
    monkeypatch.delenv("TASKPOINT_MTBF_PRIOR_S", raising=False)
    runs = {}
    for name, failures in (("new", 0), ("failing", 60)):
        url = f"file://{tmp_path / name / 'store'}"
        for _ in range(failures):  # attempts that started and failed, as a runner records them
            attempt = taskpoint.Checkpoint(url)
            attempt.mark_started()
            attempt.mark_ended("failed", "RuntimeError: planned")
        clock = Clock()
        # Steps of 10 ms: an upload commits within a step or two, below both runs'
        # Young/Daly intervals (auto never saves faster than uploads commit).
        runs[name] = train(
            tmp_path / name,
            lambda ckpt, c=clock: SaveInterval.for_checkpoint(ckpt, "auto", clock=c), clock,
            step_s=0.01,
        )

    new, failing = (runs[n][0].save_interval for n in ("new", "failing"))
    assert new is not None and failing is not None
    assert new.failures == 0 and failing.failures == 60
    assert new.mtbf_s == pytest.approx(4 * 3600, rel=0.01)  # the prior
    assert failing.mtbf_s is not None and failing.mtbf_s < 4 * 3600 / 50
    # The first save comes at the first step, to measure its cost; then the interval.
    new_steps, failing_steps = runs["new"][1].steps, runs["failing"][1].steps
    assert new_steps[0] == 1 and failing_steps[0] == 1
    assert failing.interval_s < new.interval_s
    assert len(failing_steps) > len(new_steps)


class ReleaseAtTrainEnd(TrainerCallback):
    """Opens ``gate`` at ``on_train_end``; listed before the taskpoint callback, it opens
    before that callback waits for the upload."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.gate.set()


@pytest.mark.parametrize("held", [False, True], ids=["free", "held-to-the-end"])
def test_auto_from_the_knob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool) -> None:
    """``save_every_s="auto"`` makes its interval when training begins, from the
    checkpoint, with the prior from ``TASKPOINT_MTBF_PRIOR_S``; the interval reaches the
    logs beside the saves' figures, also when the upload commits after the Trainer's last
    log (``held``: the figures come with the one more log of ``on_train_end``)."""
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "1800")
    clock, gate = Clock(), threading.Event()
    options: dict[str, Any] = {"progress": lambda moved: gate.wait(30)} if held else {}
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}", **options)
    callback = TaskpointTrainerCallback(ckpt, tmp_path / "out", save_every_s="auto")
    assert callback.save_interval is None
    saves, logged = SavedSteps(), kit.LogRecorder()
    trainer = kit.classifier_trainer(
        tmp_path / "out",
        callbacks=[logged, Tick(clock), saves, ReleaseAtTrainEnd(gate), callback],
        save_strategy="no", save_total_limit=None,
    )
    trainer.train()
    assert callback.save_interval is not None
    assert callback.save_interval.mtbf_s == pytest.approx(1800, rel=0.01)
    assert callback.save_interval.rule != "fixed"
    assert saves.steps[0] == 1  # the first save measures the cost
    # The interval and its inputs reach the logs beside the saves' figures.
    figures = [entry for entry in logged.logs if "taskpoint/upload_s" in entry]
    assert figures and all("taskpoint/interval_s" in entry for entry in figures)
    assert figures[-1]["taskpoint/mtbf_s"] == pytest.approx(1800, rel=0.01)
    if held:  # no save committed while training ran: its figures follow the last log
        assert figures == logged.logs[-1:]
        assert any("train_runtime" in entry for entry in logged.logs[:-1])


def test_bad_intervals_are_named(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    with pytest.raises(ValueError, match=r"save_every_s must be .* or \"auto\"; got '10'"):
        TaskpointTrainerCallback(ckpt, save_every_s="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"save_every_s must be a positive number .*got -1"):
        TaskpointTrainerCallback(ckpt, save_every_s=-1)
    with pytest.raises(ValueError, match=r"got True"):
        TaskpointTrainerCallback(ckpt, save_every_s=True)


@pytest.mark.slow
def test_torchrun_ranks_save_at_rank_zeros_steps(tmp_path: Path) -> None:
    """Two ranks whose clocks disagree (10 s a step on rank 0, 4 s on rank 1) save at the
    same steps: those rank 0's clock calls for."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(CHILD), f"file://{tmp_path / 'store'}", str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = {r: (tmp_path / f"saves-rank{r}.txt").read_text().split() for r in (0, 1)}
    assert steps[0] == ["3", "6", "9", "12"]
    assert steps[1] == steps[0]
    restored = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}").load_sync()
    assert restored is not None and checkpoints(restored) == [3, 6, 9, 12]

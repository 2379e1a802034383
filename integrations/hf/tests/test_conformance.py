"""The callback is a drop-in: a Trainer with it behaves, on disk and in its records, as one
without it, and the figures it adds reach every logging callback.

Each test trains the tiny BERT classifier of ``taskpoint_hf_testkit`` for a few steps on
CPU, against a real ``file://`` store.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import taskpoint_hf_testkit as kit
from taskpoint import Checkpoint
from taskpoint_hf import TaskpointTrainerCallback, last_complete_checkpoint, restore_last_checkpoint
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

SESSION = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
"""Keys of the Trainer's final logs that depend on the clock, or (``train_loss``, the mean
loss of the steps this ``train()`` call ran) on where it resumed."""


def _store(tmp_path: Path, name: str = "store", **options: Any) -> Checkpoint:
    return Checkpoint((tmp_path / name).as_uri(), keep=5, **options)


def _history(state: TrainerState) -> list[dict[str, Any]]:
    return [{k: v for k, v in h.items() if k not in SESSION} for h in state.log_history]


def _figures(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in entry.items() if k.startswith("taskpoint/")}
        for entry in logs
        if any(k.startswith("taskpoint/") for k in entry)
    ]


class SaveCounter(TrainerCallback):
    def __init__(self) -> None:
        self.saves = 0

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.saves += 1


def test_a_resumed_runs_log_history_is_an_uninterrupted_ones(tmp_path: Path) -> None:
    """Resuming from an early checkpoint of a finished run (what transformers' own resume
    tests do) reproduces its ``state.log_history`` exactly: no ``taskpoint/*`` entries."""
    out = tmp_path / "out"
    options: dict[str, Any] = {"max_steps": 6, "save_steps": 2, "save_total_limit": None}
    whole = kit.classifier_trainer(
        out, callbacks=[TaskpointTrainerCallback(_store(tmp_path, "a"))], **options
    )
    whole.train()
    resumed = kit.classifier_trainer(
        out, callbacks=[TaskpointTrainerCallback(_store(tmp_path, "b"))], **options
    )
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert _history(resumed.state) == _history(whole.state)
    assert not [k for h in whole.state.log_history for k in h if k.startswith("taskpoint/")]


@pytest.mark.parametrize("upload_delay_s", [0.0, 0.5], ids=["free", "slow"])
def test_every_saves_figures_reach_a_callback_listed_before_this_one(
    tmp_path: Path, upload_delay_s: float
) -> None:
    """``report_to`` integrations come first in the Trainer's callback list; a plain callback
    listed first stands in for them. It gets the figures of every save, the last one (whose
    upload completes at the end of training) included, through ``on_log``. A save the next
    one replaced while an upload ran is counted as coalesced: slow uploads force that, and
    a loaded machine can bring it about with free ones."""
    first, saves = kit.LogRecorder(), SaveCounter()
    slow = {"progress": lambda moved: time.sleep(upload_delay_s)} if upload_delay_s else {}
    checkpoint = _store(tmp_path, **slow)
    trainer = kit.classifier_trainer(
        tmp_path / "out",
        callbacks=[first, saves, TaskpointTrainerCallback(checkpoint)],
        max_steps=6, save_steps=2,
    )
    trainer.train()
    figures = _figures(first.logs)
    assert saves.saves == 3
    committed = sum(f["taskpoint/saves"] for f in figures)
    assert committed + sum(f.get("taskpoint/coalesced", 0) for f in figures) == 3
    assert committed == len(checkpoint.committed()) >= 1
    if upload_delay_s:
        assert committed < 3  # step 6's save replaced step 4's, waiting behind step 2's
    assert "taskpoint/saves" in first.logs[-1]  # the last save's, with the Trainer's last logs
    assert all(f["taskpoint/upload_s"] > 0 and f["taskpoint/stored_bytes"] > 0 for f in figures)
    assert not [k for h in trainer.state.log_history for k in h if k.startswith("taskpoint/")]


def test_the_store_ends_holding_what_the_trainer_kept(tmp_path: Path) -> None:
    """With ``save_total_limit=1`` and a best checkpoint, the Trainer deletes the last
    checkpoint after its last save; the store follows."""
    checkpoint = _store(tmp_path)
    out = tmp_path / "out"
    trainer = kit.classifier_trainer(
        out,
        callbacks=[TaskpointTrainerCallback(checkpoint)],
        max_steps=6, save_steps=2, eval_strategy="steps", eval_steps=2, save_total_limit=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
    )
    trainer.train()
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept != ["checkpoint-6"] and len(kept) == 1  # the scenario: the best is older
    restored = checkpoint.load_sync(into=tmp_path / "restored")
    assert restored is not None
    assert sorted(p.name for p in restored.glob("checkpoint-*")) == kept


class EmptyFile(TrainerCallback):
    """Adds an empty file to each ``checkpoint-N`` as it is saved (listed before the upload)."""

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        (Path(args.output_dir) / f"checkpoint-{state.global_step}" / "empty.txt").touch()


def test_a_checkpoint_with_an_empty_file_mirrors_and_resumes(tmp_path: Path) -> None:
    """A run resumed in place writes its checkpoints again byte for byte, so an empty file
    is a save's only new content: that save commits and the run resumes from it."""
    checkpoint = _store(tmp_path)
    out = tmp_path / "out"
    options: dict[str, Any] = {"max_steps": 4, "save_steps": 2, "save_total_limit": None}
    kit.classifier_trainer(
        out, callbacks=[TaskpointTrainerCallback(checkpoint)], **options
    ).train()
    again = kit.classifier_trainer(
        out, callbacks=[EmptyFile(), TaskpointTrainerCallback(checkpoint)], **options
    )
    again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    shutil.rmtree(out)
    args = TrainingArguments(str(out), max_steps=6, save_steps=2, use_cpu=True, report_to="none")
    resume = restore_last_checkpoint(checkpoint, args)
    assert resume == out / "checkpoint-4"
    assert (resume / "empty.txt").read_bytes() == b""
    later = kit.classifier_trainer(
        out, callbacks=[TaskpointTrainerCallback(checkpoint)], max_steps=6, save_steps=2
    )
    later.train(resume_from_checkpoint=str(resume))
    assert later.state.global_step == 6


class Gate:
    """A ``progress=`` callback holding every upload while closed."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()

    def __call__(self, moved: int) -> None:
        assert self.opened.wait(timeout=120), "the test never opened the gate"


class HoldThenStop(TrainerCallback):
    """Closes the gate at the save of ``hold`` (before the upload starts); at the save of
    ``stop``, written while that upload was held, opens it and ends the run."""

    def __init__(self, gate: Gate, hold: int, stop: int) -> None:
        self.gate, self.hold, self.stop = gate, hold, stop

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step == self.hold:
            self.gate.opened.clear()
        elif state.global_step == self.stop:
            self.gate.opened.set()
            raise kit.Interrupt(f"stopped at step {self.stop}")


def test_a_checkpoint_written_again_during_an_upload_does_not_reach_it(tmp_path: Path) -> None:
    """A resumed run writes an existing ``checkpoint-N`` again, in place, while the upload
    of an earlier save (whose snapshot shares its files) is still reading: that upload
    commits the files as they were at its save, whole."""
    out = tmp_path / "out"
    options: dict[str, Any] = {"max_steps": 6, "save_steps": 2, "save_total_limit": None}
    kit.classifier_trainer(out, **options).train()
    before = tmp_path / "checkpoint-6-before"
    shutil.copytree(out / "checkpoint-6", before)
    gate = Gate()
    checkpoint = _store(tmp_path, progress=gate)
    callback = TaskpointTrainerCallback(checkpoint)
    resumed = kit.classifier_trainer(  # gradients clipped: other bytes in checkpoint-6
        out, callbacks=[HoldThenStop(gate, hold=4, stop=6), callback],
        max_grad_norm=0.01, **options,
    )
    with pytest.raises(kit.Interrupt):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert callback.wait(timeout=120)
    assert (out / "checkpoint-6" / "model.safetensors").read_bytes() != (
        before / "model.safetensors"
    ).read_bytes()
    restored = checkpoint.load_sync(into=tmp_path / "restored")  # the save at step 4
    assert restored is not None and last_complete_checkpoint(restored) == restored / "checkpoint-6"
    for file in sorted(before.iterdir()):
        assert (restored / "checkpoint-6" / file.name).read_bytes() == file.read_bytes(), file.name

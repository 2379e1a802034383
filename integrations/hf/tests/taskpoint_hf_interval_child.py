"""The interval tests' fake clock and recorders, and a ``torchrun`` worker whose two
ranks' clocks disagree.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        taskpoint_hf_interval_child.py STORE_URL WORK_DIR

The worker trains the tiny BERT classifier for 12 steps with ``save_strategy="no"`` and
``save_every_s`` a :class:`taskpoint.SaveInterval` of 25 s on a fake clock that advances at
each step's start: 10 s a step on rank 0, 4 s on rank 1 (rank 1's clock alone would first
call for a save at step 7, rank 0's at step 3). Each rank appends the step of every save the
Trainer made (``on_save``) to ``WORK_DIR/saves-rank<R>.txt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))

STEP_S = {0: 10.0, 1: 4.0}


class Clock:
    """Seconds that pass only when :class:`Tick` says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tick(TrainerCallback):
    """Advances the clock by ``step_s`` at every step's start (a step that takes that long)."""

    def __init__(self, clock: Clock, step_s: float = 10.0) -> None:
        self.clock, self.step_s = clock, step_s

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.clock.now += self.step_s


class SavedSteps(TrainerCallback):
    """Records the step of every save the Trainer made; appends it to ``path`` if given."""

    def __init__(self, path: Path | None = None) -> None:
        self.path, self.steps = path, list[int]()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.steps.append(state.global_step)
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(f"{state.global_step}\n")


def main() -> None:
    torch.set_num_threads(1)
    import taskpoint
    import taskpoint_hf_testkit as kit
    from taskpoint_hf import TaskpointTrainerCallback

    store, work = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    clock = Clock()
    ckpt = taskpoint.Checkpoint(store)
    interval = taskpoint.SaveInterval.for_checkpoint(ckpt, 25.0, clock=clock)
    out = work / "out"
    callbacks = [
        Tick(clock, STEP_S[rank]),
        SavedSteps(work / f"saves-rank{rank}.txt"),
        TaskpointTrainerCallback(ckpt, out, save_every_s=interval),
    ]
    trainer = kit.classifier_trainer(
        out, callbacks=callbacks, save_strategy="no", save_total_limit=None, max_steps=12
    )
    trainer.train()
    kit.end_process_group()


if __name__ == "__main__":
    main()

"""A child process for the interval tests: DDP on CPU whose ranks' clocks disagree.

Usage: python interval_script.py STORE_URL WORKDIR

Trains TinyModule with two processes (``strategy="ddp"``, gloo), saving by time with
``train_time_interval`` a :class:`taskpoint.SaveInterval` of 25 s on a fake clock that
advances at each batch start: 10 s a batch on global rank 0, 4 s on rank 1 (rank 1's clock
alone would first call for a save at step 7, rank 0's at step 3). Each rank writes the global
steps at which Lightning saved a checkpoint (``on_save_checkpoint``, called on every rank) to
``WORKDIR/saves-rank<R>.txt``, one a line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import lightning as L
import testlib as lib
from taskpoint import Checkpoint, SaveInterval
from taskpoint_lightning import TaskpointModelCheckpoint

STEP_S = {0: 10.0, 1: 4.0}


class Clock:
    """Seconds that pass only when :class:`Tick` says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tick(L.Callback):
    """Advances the clock by ``step_s`` at every batch start."""

    def __init__(self, clock: Clock, step_s: float) -> None:
        self.clock, self.step_s = clock, step_s

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.now += self.step_s


class SavedSteps(L.Callback):
    """Appends the global step of every checkpoint saved on this rank to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        with self.path.open("a") as fh:
            fh.write(f"{trainer.global_step}\n")


def main() -> None:
    store, workdir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher sets it on rank 1
    clock = Clock()
    ckpt = Checkpoint(store)
    interval = SaveInterval.for_checkpoint(ckpt, 25.0, clock=clock)
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=workdir / "ckpts", save_top_k=-1, train_time_interval=interval
    )
    L.seed_everything(0)
    trainer = lib.trainer(
        [Tick(clock, STEP_S[rank]), mc, SavedSteps(workdir / f"saves-rank{rank}.txt")],
        max_epochs=4, devices=2, strategy="ddp", default_root_dir=workdir,
    )
    trainer.fit(lib.TinyModule(), lib.loader("shuffle"))
    lib.exit_now()


if __name__ == "__main__":
    main()

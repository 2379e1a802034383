"""Lightning training that fails on purpose and resumes from its mirrored checkpoints.

A tiny LightningModule trains on CPU for nine epochs. ``TaskpointModelCheckpoint`` writes
``last.ckpt`` after every epoch and mirrors the checkpoint folder to the store; a
simulated failure stops each attempt partway, and ``resume_ckpt_path`` hands the retry
the newest mirrored ``last.ckpt`` so ``Trainer.fit`` continues from there. The random
state travels with the checkpoint, so the final weights equal those of a run that never
failed, bit for bit; the script checks that at the end.

Run it with ``uv run python examples/lightning_checkpoint.py``. Checkpoints go to the
embedded local store, ``./.taskpoint/checkpoints`` (or ``$TASKPOINT_ROOT``).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import taskpoint
import torch
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

RETRIES = 3
MAX_EPOCHS = 9
FEATURES = 8

env = taskpoint.TaskEnvironment(name="lightning_checkpoint")


class TinyModule(L.LightningModule):
    """A small MLP with dropout; ``fail`` makes it raise every ``MAX_EPOCHS // RETRIES``
    epochs after the epoch its attempt started at."""

    def __init__(self, attempt: int = 0, fail: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)
        )
        self.attempt = attempt
        self.fail = fail
        self.start_epoch = 0

    def on_train_start(self) -> None:
        # Lightning has restored the checkpoint by now: this is where the attempt begins.
        self.start_epoch = self.current_epoch
        if self.fail:
            print(
                f"attempt {self.attempt}: starting at epoch {self.current_epoch} "
                f"(global step {self.global_step}) of {MAX_EPOCHS}"
            )

    def on_train_epoch_start(self) -> None:
        failure_interval = MAX_EPOCHS // RETRIES
        epoch = self.current_epoch
        if self.fail and epoch > self.start_epoch and epoch % failure_interval == 0:
            # Simulate a failure so the next attempt resumes from the checkpoint
            raise RuntimeError(f"Simulated failure at epoch {epoch}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def make_loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, FEATURES, generator=g)
    y = x[:, :3].sum(dim=1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # shuffles every epoch


def make_trainer(callbacks: list[L.Callback], root: Path) -> L.Trainer:
    return L.Trainer(
        max_epochs=MAX_EPOCHS,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


@env.task(retries=RETRIES)
def train_lightning(workdir: Path) -> dict[str, torch.Tensor]:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    checkpoint = context.checkpoint
    ckpt_dir = workdir / "pl_checkpoints"

    L.seed_everything(0, verbose=False)
    model = TinyModule(attempt=context.attempt, fail=True)
    # Mirrors ckpt_dir to the store after each save Lightning finishes.
    mc = TaskpointModelCheckpoint(checkpoint, dirpath=ckpt_dir, save_last=True)
    trainer = make_trainer([mc], workdir)
    # None on the first attempt; afterwards the newest last.ckpt, restored into ckpt_dir.
    trainer.fit(model, make_loader(), ckpt_path=resume_ckpt_path(checkpoint, dirpath=ckpt_dir))
    return {k: v.clone() for k, v in model.state_dict().items()}


def train_without_failures(workdir: Path) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    model = TinyModule()
    make_trainer([], workdir).fit(model, make_loader())
    return {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("lightning.pytorch", "lightning.fabric"):  # quieter: no per-fit banners
        logging.getLogger(name).setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        resumed = train_lightning(Path(tmp) / "retried")
        reference = train_without_failures(Path(tmp) / "reference")
    same = all(torch.equal(resumed[k], reference[k]) for k in reference)
    print(f"final weights equal to a run that never failed: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

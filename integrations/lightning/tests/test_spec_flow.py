"""The spec's ``train_lightning`` flow runs on taskpoint with only the import changed:
its own ModelCheckpoint subclass, ``checkpoint.load_sync`` and ``latest_checkpoint``."""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import taskpoint as flyte
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")

FEATURES = 4
RETRIES = 3
STARTS: list[int] = []
FAIL_AT_EPOCH: set[int] = set()


class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)

    def on_train_start(self) -> None:
        STARTS.append(self.current_epoch)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch in FAIL_AT_EPOCH:
            FAIL_AT_EPOCH.discard(self.current_epoch)
            raise RuntimeError(f"Simulated failure at epoch {self.current_epoch}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def make_loader() -> DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, FEATURES, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


# ---- from the spec, verbatim but for `import taskpoint as flyte` above ----------------


class FlyteLightningCheckpointCallback(ModelCheckpoint):
    """A `ModelCheckpoint` that mirrors `dirpath` to the Flyte checkpoint after each epoch."""

    def __init__(self, flyte_checkpoint: flyte.Checkpoint, *, dirpath: str | pathlib.Path, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(dirpath=str(dirpath), **kwargs)
        self._flyte_checkpoint = flyte_checkpoint

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self.dirpath:
            # Lightning callbacks are synchronous, so use save_sync
            self._flyte_checkpoint.save_sync(pathlib.Path(self.dirpath))


def make_task(env: flyte.TaskEnvironment) -> Any:
    @env.task(retries=RETRIES)
    def train_lightning(max_epochs: int = 10) -> float:
        checkpoint = flyte.ctx().checkpoint

        ckpt_dir = pathlib.Path("pl_checkpoints")
        ckpt_dir.mkdir(parents=True, exist_ok=True)

        # Restore the previous attempt's checkpoint tree and find the newest last.ckpt.
        resume_ckpt = None
        prev = checkpoint.load_sync()
        if prev:
            last = flyte.latest_checkpoint(prev)
            if last:
                resume_ckpt = str(last)

        model = TinyModule()
        mc = FlyteLightningCheckpointCallback(
            checkpoint,
            dirpath=ckpt_dir,
            filename="last",
            save_last=True,
            save_top_k=1,
        )
        trainer = L.Trainer(
            max_epochs=max_epochs,
            enable_checkpointing=True,
            callbacks=[mc],
            enable_progress_bar=True,
            logger=False,
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(model, make_loader(), ckpt_path=resume_ckpt)

        with torch.no_grad():
            return float(model(torch.ones(1, FEATURES)).squeeze().item())

    return train_lightning


# ---------------------------------------------------------------------------------------


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, fail: set[int]) -> float:
    workdir = tmp_path / name
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    STARTS.clear()
    FAIL_AT_EPOCH.clear()
    FAIL_AT_EPOCH.update(fail)
    L.seed_everything(0)
    env = flyte.TaskEnvironment(name="spec_lightning", root=f"file://{tmp_path / 'store'}")
    result: float = make_task(env)(max_epochs=6)
    return result


def test_spec_train_lightning_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uninterrupted = run(tmp_path, monkeypatch, "uninterrupted", set())
    assert STARTS == [0]
    resumed = run(tmp_path, monkeypatch, "interrupted", {2, 4})
    assert STARTS == [0, 2, 4]  # each retry starts after the last mirrored epoch
    assert resumed == uninterrupted

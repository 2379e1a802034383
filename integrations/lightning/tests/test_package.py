"""Public names, the supported Lightning range, and the pytorch_lightning flavour."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import taskpoint
import taskpoint_lightning
import torch
from taskpoint_lightning import resume_ckpt_path
from taskpoint_lightning._compat import check_lightning_version


def test_all_lists_every_public_name() -> None:
    public = {
        name for name, value in vars(taskpoint_lightning).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    public.discard("check_lightning_version")  # the import-time check, not API
    assert set(taskpoint_lightning.__all__) == public | {"__version__"}
    for name in taskpoint_lightning.__all__:
        assert getattr(taskpoint_lightning, name) is not None


@pytest.mark.parametrize("found", ["2.3.3", "3.0.0", "nightly"])
def test_unsupported_lightning_is_refused(found: str) -> None:
    with pytest.raises(ImportError, match=rf"requested lightning>=2\.4,<3 but found lightning {found}"):
        check_lightning_version(found)


def test_supported_lightning_passes() -> None:
    assert check_lightning_version("2.4.0") == "2.4.0"
    assert check_lightning_version() == __import__("lightning").__version__
    with pytest.raises(ImportError, match=r"requested pytorch-lightning>=2\.4,<3"):
        check_lightning_version("1.9.5", distribution="pytorch-lightning")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_pytorch_lightning_flavour_mirrors_and_resumes(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from taskpoint_lightning.pytorch_lightning import TaskpointModelCheckpoint

    class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.started: int | None = None

        def on_train_start(self) -> None:
            self.started = self.current_epoch

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(epochs: int) -> Any:
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)))
        model = Module()
        mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", save_last=True)
        trainer = pl.Trainer(
            max_epochs=epochs, callbacks=[mc], logger=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
        )
        trainer.fit(model, data, ckpt_path=resume_ckpt_path(ckpt, dirpath=tmp_path / "ckpts"))
        return model

    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    assert fit(2).started == 0
    assert fit(3).started == 2

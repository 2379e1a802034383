"""``TaskpointModelCheckpoint`` and ``resume_ckpt_path`` on Flyte's own checkpoint: a real
local Flyte run with retries resumes from the previous attempt's last checkpoint and ends
bit for bit where an uninterrupted run does."""

from __future__ import annotations

import datetime
from pathlib import Path

import flyte
import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
    # flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
    pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning"),
]

# Flyte's local controller waits 0.5 s, 1 s, 2 s... between attempts unless told otherwise.
NO_WAIT = flyte.Backoff(base=datetime.timedelta(0))




def test_flyte_retries_resume_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    L.seed_everything(0)
    model = lib.TinyModule()
    lib.trainer([], enable_checkpointing=False, default_root_dir=tmp_path / "ref").fit(
        model, lib.loader("shuffle")
    )
    reference = lib.weights(model)

    env = flyte.TaskEnvironment(name="tp_lightning_flyte")
    dirpath = tmp_path / "ckpts"
    fail = {7, 16}  # attempt 1 dies in epoch 1 (epoch 0 saved), attempt 2 in epoch 3
    starts: list[tuple[int, int] | None] = []
    finals: list[dict[str, torch.Tensor]] = []
    kinds: list[bool] = []

    @env.task(retries=flyte.RetryStrategy(count=len(fail), backoff=NO_WAIT))
    def train() -> int:
        ckpt = flyte.ctx().checkpoint
        kinds.append(isinstance(ckpt, taskpoint.Checkpoint))
        L.seed_everything(0)
        module = lib.TinyModule(fail_at=fail)
        mc = TaskpointModelCheckpoint(ckpt, dirpath=dirpath, every_n_epochs=1, save_last=True)
        trainer = lib.trainer([mc], default_root_dir=tmp_path)
        try:
            trainer.fit(
                module, lib.loader("shuffle"), ckpt_path=resume_ckpt_path(ckpt, dirpath=dirpath)
            )
        finally:
            starts.append(module.started_at)
        finals.append(lib.weights(module))
        return len(starts)

    flyte.init()
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "flyte-raw")).run(train)

    assert run.outputs()[0] == 3, "three attempts: two failed, the third finished"
    assert kinds == [False, False, False], "the checkpoint was Flyte's, not taskpoint's"
    assert not fail, "every planned failure happened"
    # (epoch, global step) each attempt started at: 5 steps per epoch, saves at epoch ends.
    assert starts == [(0, 0), (1, 5), (3, 15)]
    assert len(finals) == 1
    lib.assert_bitwise_equal(finals[0], reference)

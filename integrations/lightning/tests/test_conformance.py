"""``TaskpointModelCheckpoint`` stands in for Lightning's ``ModelCheckpoint``: it survives
the copies Lightning makes of its callbacks (``ddp_spawn`` pickles them into its workers),
and its resumable state is plain values Lightning can compare and load back."""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from taskpoint_lightning import RNG_STATE_KEY, TaskpointModelCheckpoint, resume_ckpt_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")

SCRIPT = Path(__file__).with_name("train_script.py")
MACHINERY = {"_job_mirror", "_preempt_contexts", "_fit"}
"""The callback's attributes that belong to the process it runs in, never copied."""


def store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def fit(
    mc: TaskpointModelCheckpoint, tmp_path: Path, max_epochs: int, *extra: L.Callback,
    ckpt_path: str | None = None,
) -> L.Trainer:
    L.seed_everything(0)
    trainer = lib.trainer([*extra, mc], max_epochs=max_epochs, default_root_dir=tmp_path)
    trainer.fit(lib.TinyModule(), lib.loader("shuffle"), ckpt_path=ckpt_path)
    return trainer


def settings(mc: TaskpointModelCheckpoint) -> dict[str, Any]:
    """The callback's attributes but its machinery and the logging methods of the module
    Lightning attached it to (bound to a copy of the module in a copy)."""
    return {k: v for k, v in vars(mc).items() if k not in {*MACHINERY, "log", "log_dict"}}


def test_a_new_callback_pickles_and_deep_copies_to_an_equal_one(tmp_path: Path) -> None:
    mc = TaskpointModelCheckpoint(
        taskpoint.Checkpoint(store(tmp_path), keep=2), dirpath=tmp_path / "ckpts",
        monitor="train_loss", save_top_k=2, save_last=True, blocking=False, timeout=30.0,
    )

    for twin in (pickle.loads(pickle.dumps(mc)), copy.deepcopy(mc)):
        assert type(twin) is TaskpointModelCheckpoint
        assert vars(twin) == vars(mc)
        assert twin.checkpoint == mc.checkpoint and twin.checkpoint is not mc.checkpoint
        assert twin.state_key == mc.state_key


def test_a_callback_copied_while_its_mirror_uploads_waits_for_the_commit(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    url = store(tmp_path)
    # A background upload (in a thread, with a progress callback) held at the gate.
    ckpt = taskpoint.Checkpoint(url, progress=lambda moved: gate.wait(60))
    mc = TaskpointModelCheckpoint(ckpt, dirpath=tmp_path / "ckpts", save_last=True)
    seen: dict[str, Any] = {}

    class CopyInSecondEpoch(L.Callback):
        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.current_epoch != 1:
                return
            seen["before"] = taskpoint.Checkpoint(url).committed()
            opener = threading.Timer(0.2, gate.set)
            opener.start()
            seen["copy"] = copy.deepcopy(mc)
            opener.join()
            seen["after"] = taskpoint.Checkpoint(url).committed()

    fit(mc, tmp_path, 2, CopyInSecondEpoch())

    assert seen["before"] == []  # epoch 0's mirror was still uploading
    assert len(seen["after"]) == 1  # the copy was made once it had committed
    twin = seen["copy"]
    assert twin.checkpoint == mc.checkpoint and twin._job_mirror is None


def test_a_callback_pickled_after_fit_trains_on_and_mirrors_to_the_same_store(
    tmp_path: Path,
) -> None:
    url = store(tmp_path)
    mc = TaskpointModelCheckpoint(
        taskpoint.Checkpoint(url), dirpath=tmp_path / "ckpts", monitor="train_loss",
        save_top_k=2, save_last=True,
    )
    fit(mc, tmp_path, 2)

    twin = pickle.loads(pickle.dumps(mc))

    assert settings(twin) == settings(mc) and twin._job_mirror is None
    ckpt_path = resume_ckpt_path(twin.checkpoint, dirpath=tmp_path / "ckpts")
    fit(twin, tmp_path, 3, ckpt_path=ckpt_path)
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None
    assert torch.load(restored / "last.ckpt", weights_only=True)["epoch"] == 2


def test_callback_state_is_plain_values_that_compare_and_load_back(tmp_path: Path) -> None:
    dirpath = tmp_path / "ckpts"
    options: dict[str, Any] = {
        "dirpath": dirpath, "monitor": "train_loss", "save_top_k": 2, "save_last": True,
    }
    mc = TaskpointModelCheckpoint(taskpoint.Checkpoint(store(tmp_path)), **options)
    trainer = fit(mc, tmp_path, 2)  # (held: the callback may look its trainer up)

    state = mc.state_dict()

    assert RNG_STATE_KEY not in state
    assert state == copy.deepcopy(state)  # multi-element tensors would refuse ==
    fresh = TaskpointModelCheckpoint(taskpoint.Checkpoint(store(tmp_path)), **options)
    fresh.load_state_dict(state)
    restored = fresh.state_dict()
    assert restored.pop("current_score") is None  # ModelCheckpoint never restores it
    assert restored == {k: v for k, v in state.items() if k != "current_score"}
    assert trainer.checkpoint_callback is mc


@pytest.mark.parametrize("layout", ["beside the callbacks", "in the callback's entry"])
def test_loading_a_checkpoint_restores_the_random_state(tmp_path: Path, layout: str) -> None:
    """The random state sits beside the callbacks' states; checkpoints that kept it in the
    callback's own entry (taskpoint-lightning 0.1) restore it too."""
    dirpath = tmp_path / "ckpts"
    mc = TaskpointModelCheckpoint(taskpoint.Checkpoint(store(tmp_path)), dirpath=dirpath,
                                  save_last=True)
    fit(mc, tmp_path, 1)
    saved = torch.load(dirpath / "last.ckpt", weights_only=True)
    stored = saved[RNG_STATE_KEY]
    if layout != "beside the callbacks":
        saved["callbacks"][mc.state_key][RNG_STATE_KEY] = saved.pop(RNG_STATE_KEY)

    torch.manual_seed(12345)
    resumed = TaskpointModelCheckpoint(taskpoint.Checkpoint(store(tmp_path)), dirpath=dirpath,
                                       save_last=True)
    resumed.on_load_checkpoint(lib.trainer([resumed]), lib.TinyModule(), saved)

    assert torch.equal(torch.get_rng_state(), stored["ranks"][0]["torch"])


def run_spawn(store_url: str, workdir: Path, max_epochs: int) -> tuple[int, int]:
    """Train under ``ddp_spawn`` on two CPU processes; where training started."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), store_url, str(workdir), str(workdir / "final.pt"),
         "--devices", "2", "--strategy", "ddp_spawn", "--mode", "epoch",
         "--max-epochs", str(max_epochs)],
        capture_output=True, text=True, timeout=400, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("STARTED "))
    epoch, step = line.split()[1:3]
    saves = dict(x.split()[1:3] for x in done.stdout.splitlines() if x.startswith("TORCH_SAVES "))
    # Only the rank writing the checkpoint saves anything: gathering every rank's random
    # state once pickled tensors, which calls torch.save on every rank.
    assert saves.get("1") == "0", saves
    return int(epoch), int(step)


@pytest.mark.slow
def test_ddp_spawn_workers_mirror_and_a_new_run_resumes_from_the_store(tmp_path: Path) -> None:
    url, workdir = store(tmp_path), tmp_path / "run"
    assert run_spawn(url, workdir, max_epochs=1) == (0, 0)
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None
    steps = torch.load(restored / "last.ckpt", weights_only=True)["global_step"]
    assert steps > 0

    shutil.rmtree(workdir / "ckpts")  # a new machine: the checkpoint comes from the store
    assert run_spawn(url, workdir, max_epochs=2) == (1, steps)
    restored = taskpoint.Checkpoint(url).load_sync()
    assert restored is not None
    last = torch.load(restored / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (1, 2 * steps)
    assert len(last[RNG_STATE_KEY]["ranks"]) == 2  # each worker's random state
    assert torch.load(workdir / "final.pt")["net.0.weight"].isfinite().all()

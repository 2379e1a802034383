"""Interrupted runs finish bitwise equal to an uninterrupted run (in-process retries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Uninterrupted runs' final weights, one per kind of loader."""
    out = {}
    for kind in ("shuffle", "resumable"):
        L.seed_everything(0)
        model = lib.TinyModule()
        root = tmp_path_factory.mktemp("reference")
        lib.trainer([], enable_checkpointing=False, default_root_dir=root).fit(
            model, lib.loader(kind)
        )
        out[kind] = lib.weights(model)
    return out


def run_with_retries(
    tmp_path: Path, root: str, kind: str, fail_at: set[int],
    trainer_kwargs: dict[str, Any] | None = None, **mc_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], list[tuple[int, int] | None]]:
    env = taskpoint.TaskEnvironment(name="lightning-tests", root=root)
    dirpath = tmp_path / "ckpts"
    fail = set(fail_at)
    starts: list[tuple[int, int] | None] = []

    @env.task(retries=len(fail_at), backoff=0)
    def train() -> dict[str, torch.Tensor]:
        ctx = taskpoint.ctx()
        assert ctx is not None and ctx.checkpoint is not None
        ckpt = ctx.checkpoint
        L.seed_everything(0)
        model = lib.TinyModule(fail_at=fail)
        mc = TaskpointModelCheckpoint(ckpt, dirpath=dirpath, **mc_kwargs)
        trainer = lib.trainer([mc], default_root_dir=tmp_path, **(trainer_kwargs or {}))
        try:
            trainer.fit(model, lib.loader(kind), ckpt_path=resume_ckpt_path(ckpt, dirpath=dirpath))
        finally:
            starts.append(model.started_at)
        return {k: v.cpu() for k, v in lib.weights(model).items()}

    return train(), starts


@pytest.mark.parametrize("save_last", [
    # A copied last.ckpt on every store; the linked one differs only on the local disk, so
    # the file store and one object store are enough for it (each case trains three times).
    True, pytest.param("link", marks=pytest.mark.stores("file", "s3")),
])
def test_epoch_end_saves_resume_exactly(
    tmp_path: Path, store_url: str, reference: dict[str, Any], save_last: Any
) -> None:
    final, starts = run_with_retries(
        tmp_path, store_url, "shuffle", {7, 16}, every_n_epochs=1, save_last=save_last
    )
    assert starts == [(0, 0), (1, 5), (3, 15)]
    lib.assert_bitwise_equal(final, reference["shuffle"])


@pytest.mark.parametrize("save_last", [True, "link"])
def test_mid_epoch_saves_resume_exactly(
    tmp_path: Path, reference: dict[str, Any], save_last: Any
) -> None:
    # every 3 steps with 5 batches per epoch: resumes inside epochs (steps 6 and 12) and
    # from a save on an epoch's last batch (step 15). That one comes last: Lightning 2.6
    # miscounts epochs when another mid-epoch resume follows it, with or without taskpoint.
    final, starts = run_with_retries(
        tmp_path, f"file://{tmp_path / 'store'}", "resumable", {8, 13, 16},
        every_n_train_steps=3, save_last=save_last,
    )
    assert [s[1] for s in starts if s] == [0, 6, 12, 15]
    lib.assert_bitwise_equal(final, reference["resumable"])


@pytest.mark.gpu
def test_cuda_random_state_resumes_exactly(tmp_path: Path) -> None:
    """On CUDA the input noise and dropout draw from the CUDA generator: it is kept too."""
    on_cuda = {"accelerator": "cuda"}
    L.seed_everything(0)
    model = lib.TinyModule()
    lib.trainer([], enable_checkpointing=False, default_root_dir=tmp_path, **on_cuda).fit(
        model, lib.loader("resumable")
    )
    reference = {k: v.cpu() for k, v in lib.weights(model).items()}

    final, starts = run_with_retries(
        tmp_path, f"file://{tmp_path / 'store'}", "resumable", {8, 13},
        trainer_kwargs=on_cuda, every_n_train_steps=3, save_last=True,
    )
    assert [s[1] for s in starts if s] == [0, 6, 12]
    lib.assert_bitwise_equal(final, reference)
    saved = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)
    assert len(saved["taskpoint_rng"]["ranks"][0]["torch.cuda"]) == torch.cuda.device_count()

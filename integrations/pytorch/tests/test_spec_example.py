"""The spec's ``train_linear`` task runs on taskpoint as written, with only
``import taskpoint as flyte``: plain ``torch.save``/``torch.load`` and ``checkpoint.save(path)``."""

from __future__ import annotations

import logging
import pathlib

import pytest
import taskpoint as flyte
import torch
from torch import nn

RETRIES = 3


async def test_spec_train_linear_runs_as_written(
    store_url: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)  # the task writes pytorch_linear/training.pt relative to it
    env = flyte.TaskEnvironment(name="checkpoint_pytorch", root=store_url, run_id="spec")

    # --- verbatim from the spec (pytorch_checkpoint.py) ---
    @env.task(retries=RETRIES)
    async def train_linear(epochs: int = 10) -> float:
        checkpoint = flyte.ctx().checkpoint

        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        # Resume model, optimizer, and epoch from the previous attempt, if any.
        prev = await checkpoint.load()
        if prev:
            blob = torch.load(prev, map_location="cpu", weights_only=False)
            model.load_state_dict(blob["model"])
            opt.load_state_dict(blob["opt"])
            start = int(blob["epoch"]) + 1
        else:
            start = 0

        wpath = pathlib.Path("pytorch_linear") / "training.pt"
        wpath.parent.mkdir(parents=True, exist_ok=True)

        failure_interval = epochs // RETRIES
        for epoch in range(start, epochs):
            x = torch.randn(8, 4)
            y = torch.randn(8, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

            if epoch > start and epoch % failure_interval == 0:
                # Simulate a failure so the next attempt resumes from the checkpoint
                raise RuntimeError(f"Simulated failure at epoch {epoch}")

            # Save model, optimizer, and epoch state to object storage.
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                wpath,
            )
            await checkpoint.save(wpath)

        with torch.no_grad():
            return float(model(torch.ones(1, 4)).squeeze().item())
    # --- end of the spec's code ---

    with caplog.at_level(logging.WARNING, logger="taskpoint.runtime"):
        result = await train_linear()

    assert isinstance(result, float)
    failures = [
        r.getMessage() for r in caplog.records
        if r.name.startswith("taskpoint.runtime") and "failed" in r.getMessage()
    ]
    assert len(failures) == 3
    assert [f.split("Simulated failure at epoch ")[1].split(";")[0] for f in failures] == ["3", "6", "9"]

    # The last attempt (3) committed epoch 9 as the plain file, which loads weights_only too.
    store = flyte.Checkpoint(f"{store_url}/checkpoint_pytorch.train_linear/spec")
    newest = store.committed()[0]
    assert (newest.attempt, newest.kind, newest.name) == (3, "file", "training.pt")
    restored = store.load_sync()
    assert restored is not None and restored.name == "training.pt"
    blob = torch.load(restored, weights_only=True)
    assert blob["epoch"] == 9 and set(blob) == {"model", "opt", "epoch"}

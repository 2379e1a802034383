"""The spec's ``train_linear`` task, resumed exactly with taskpoint-pytorch.

Run it::

    uv run python examples/pytorch_checkpoint.py

The task fails on purpose at epochs 3, 6 and 9, and has three retries. Each retry restores
the model, the optimizer, the epoch counter and the RNG states saved by the attempt before
it, and carries on from there. The random batches come from the restored RNG, so the
result equals an uninterrupted run's to the last bit; the example runs one to show it.

Checkpoints go to the embedded local store, ``./.taskpoint/checkpoints``, unless
``TASKPOINT_ROOT`` names another location (``s3://bucket/prefix``, ``gs://...``).
"""

from __future__ import annotations

import asyncio

import taskpoint
import torch
from taskpoint_pytorch import TaskpointState
from torch import nn

env = taskpoint.TaskEnvironment(name="checkpoint_pytorch")

RETRIES = 3


def make_model() -> tuple[nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_epoch(model: nn.Linear, opt: torch.optim.SGD) -> None:
    x = torch.randn(8, 4)
    y = torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def predict(model: nn.Linear) -> float:
    with torch.no_grad():
        return float(model(torch.ones(1, 4)).squeeze().item())


@env.task(retries=RETRIES)
async def train_linear(epochs: int = 10) -> float:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    checkpoint = context.checkpoint

    model, opt = make_model()
    state = TaskpointState(model, opt)

    # Resume model, optimizer, epoch and RNG states from the previous attempt, if any.
    resume = await state.restore(checkpoint)
    start = resume.epoch if resume else 0
    how = "resumed from the checkpoint" if resume else "nothing saved yet"
    print(f"attempt {context.attempt}: starting at epoch {start} ({how})", flush=True)

    failure_interval = epochs // RETRIES
    for epoch in range(start, epochs):
        train_epoch(model, opt)

        if epoch > start and epoch % failure_interval == 0:
            # Simulate a failure so the next attempt resumes from the checkpoint
            print(f"attempt {context.attempt}: simulated failure at epoch {epoch}", flush=True)
            raise RuntimeError(f"Simulated failure at epoch {epoch}")

        # Save the state to object storage; the next epoch to run is epoch + 1.
        await state.save(checkpoint, epoch=epoch + 1)

    return predict(model)


def train_uninterrupted(epochs: int = 10) -> float:
    """The same training with no failures and no checkpoints, for comparison."""
    model, opt = make_model()
    for _ in range(epochs):
        train_epoch(model, opt)
    return predict(model)


if __name__ == "__main__":
    result = asyncio.run(train_linear())
    reference = train_uninterrupted()
    print(f"resumed run:       {result!r}")
    print(f"uninterrupted run: {reference!r}")
    print(f"identical: {result == reference}")

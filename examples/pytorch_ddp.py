"""DistributedDataParallel under torchrun: a worker dies, torchrun restarts the group, and
every rank resumes from the same checkpoint.

Run it (2 CPU workers, gloo backend)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 uv run torchrun --standalone --nproc_per_node=2 \
        --max-restarts=2 examples/pytorch_ddp.py

or ``uv run python examples/pytorch_ddp.py``, which starts that torchrun command itself.
The variable gives each restarted group a fresh rendezvous store: with the store torchrun
shares by default, a restarted worker can read the old group's addresses and fail to
connect (pytorch/pytorch#135712).

In the group's first run rank 1 crashes in epoch 2. torchrun restarts both workers; each
restores the model, optimizer, LR scheduler, counters and its own RNG states from the last
committed checkpoint, and training finishes. Every rank calls ``save``, but only rank 0
writes to the store; the others wait until the commit is done.

Checkpoints go to ``./.taskpoint/checkpoints/pytorch_ddp/<torchrun run id>`` unless
``TASKPOINT_ROOT`` names another root (shared by every node: ``s3://bucket/prefix``, ...).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import taskpoint
import torch
import torch.distributed as dist
from taskpoint_pytorch import TaskpointState
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 4
CRASH_EPOCH = 2


def report(line: str) -> None:
    """Print one line in a single write, so the ranks' lines never interleave, even under
    ``PYTHONUNBUFFERED=1`` (where ``print`` writes the text and its newline separately)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checkpoint_url() -> str:
    root = os.environ.get("TASKPOINT_ROOT") or str(Path(".taskpoint/checkpoints").absolute())
    # torchrun keeps TORCHELASTIC_RUN_ID across restarts of the group.
    return f"{root.rstrip('/')}/pytorch_ddp/{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    torch.manual_seed(1 + rank)  # per-rank dropout masks and noise
    np.random.seed(1 + rank)
    random.seed(1 + rank)

    gen = torch.Generator().manual_seed(42)
    x = torch.randn(256, 8, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)

    checkpoint = taskpoint.Checkpoint(checkpoint_url())
    state = TaskpointState(ddp, optimizer, scheduler)
    resume = state.restore_sync(checkpoint)
    start, step = (resume.epoch, resume.step) if resume else (0, 0)
    report(f"[rank {rank}/{world}, run {restart}] starting at epoch {start} (step {step})")

    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)  # the shuffle order is a function of the epoch
        for xb, yb in loader:
            step += 1
            noise = torch.from_numpy(np.random.normal(0, 0.01, size=tuple(xb.shape)).astype(np.float32))
            loss = nn.functional.mse_loss(ddp(xb + noise), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if restart == 0 and rank == 1 and epoch == CRASH_EPOCH:
            report(f"[rank {rank}] simulated crash in epoch {epoch}")
            os._exit(1)
        scheduler.step()
        # Every rank calls save; rank 0 writes and commits, the others wait for it.
        state.save_sync(checkpoint, epoch=epoch + 1, step=step, extra={"loss": loss.item()})
        if rank == 0:
            report(f"[rank 0] epoch {epoch} done, loss {loss.item():.4f}, checkpoint committed")

    # Every rank ends with the same weights.
    digest = torch.cat([p.detach().flatten() for p in model.parameters()]).sum().item()
    digests: list[float] = [0.0] * world
    dist.all_gather_object(digests, digest)
    if rank == 0:
        report(f"done after {step} steps; ranks hold identical weights: {len(set(digests)) == 1}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        from torch.distributed.run import main as torchrun

        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        torchrun(
            ["--standalone", "--nproc_per_node=2", "--max-restarts=2", "--monitor-interval=0.2",
             *sys.argv[:1]]
        )

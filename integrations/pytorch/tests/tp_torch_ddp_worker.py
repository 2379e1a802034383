"""A DDP worker for the torchrun tests (gloo, CPU).

Usage: torchrun --nproc_per_node=2 [--max-restarts=N] tp_torch_ddp_worker.py URL OUT
       [--kill-rank R --kill-step S]

It trains a small DDP model with a shuffling ``DistributedSampler``, dropout drawn
from per-rank seeds, Adam and StepLR, saving a ``TaskpointState`` each epoch. In the first
incarnation of the group (TORCHELASTIC_RESTART_COUNT 0), rank R SIGKILLs itself before
global step S. Each rank appends JSON events (start, resume, save calls) to
``OUT/events-rank<R>.jsonl`` and, when done, writes its final state to
``OUT/final-rank<R>.pt``. Then the same processes train again from scratch, without
checkpoints or failures, and write that uninterrupted reference to
``OUT/reference-rank<R>.pt``. Last, the processes run failure scenarios (against a
store under ``OUT/errors-store``) and write each rank's outcomes to
``OUT/errors-rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import taskpoint
import torch
import torch.distributed as dist
from taskpoint_pytorch import TaskpointState
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 4
SAMPLES = 32
BATCH = 4


class RecordingCheckpoint:
    """Delegates to a checkpoint and logs every call, with this process's rank and pid."""

    def __init__(self, inner: Any, events: Path) -> None:
        self.inner = inner
        self.events = events

    def log(self, **event: Any) -> None:
        with self.events.open("a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), **event}) + "\n")

    def save_sync(self, data: Any) -> None:
        self.log(event="save")
        self.inner.save_sync(data)

    async def save(self, data: Any) -> None:
        self.log(event="save")
        await self.inner.save(data)

    def load_sync(self) -> Path | None:
        return self.inner.load_sync()

    async def load(self) -> Path | None:
        return await self.inner.load()


def train(args: argparse.Namespace, rank: int, restart: int, out: Path, *, reference: bool) -> None:
    recorder = RecordingCheckpoint(taskpoint.Checkpoint(args.url), out / f"events-rank{rank}.jsonl")
    if not reference:
        recorder.log(event="start", restart=restart)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    # Per-rank streams: each rank's own RNG state must come back for an exact resume.
    torch.manual_seed(100 + rank)
    np.random.seed(100 + rank)
    random.seed(100 + rank)

    gen = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(SAMPLES, 6, generator=gen), torch.randn(SAMPLES, 1, generator=gen))
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

    state = TaskpointState(ddp, optimizer, scheduler)
    resume = None if reference else state.restore_sync(recorder)
    if not reference:
        recorder.log(
            event="resume", epoch=resume.epoch if resume else None, step=resume.step if resume else None
        )
    start, step = (resume.epoch, resume.step) if resume else (0, 0)
    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            step += 1
            if not reference and restart == 0 and rank == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            noise = torch.from_numpy(np.random.normal(0, 0.05, size=tuple(xb.shape)).astype(np.float32))
            loss = nn.functional.mse_loss(ddp(xb + noise) * (1 + random.uniform(-0.1, 0.1)), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
        if not reference:
            state.save_sync(recorder, epoch=epoch + 1, step=step)
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
        out / f"{'reference' if reference else 'final'}-rank{rank}.pt",
    )


class FailingCheckpoint(RecordingCheckpoint):
    tried = threading.Event()

    def save_sync(self, data: Any) -> None:
        self.tried.set()
        raise RuntimeError("store unavailable (simulated)")

    def load_sync(self) -> Path | None:
        raise RuntimeError("download failed (simulated)")


def errors(rank: int, out: Path) -> None:
    outcomes: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            outcomes[name] = "ok"
        except Exception as exc:
            outcomes[name] = f"{type(exc).__name__}: {exc}"

    model = nn.Linear(3, 1)
    state = TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    events = out / f"errors-events-rank{rank}.jsonl"
    # memory:// is private to each process: only rank 0 sees what rank 0 committed.
    private = taskpoint.Checkpoint(f"memory://taskpoint-ddp-errors/{out.name}")
    attempt("private-save", lambda: state.save_sync(private, epoch=1))
    attempt("private-restore", lambda: state.restore_sync(private))
    shared = RecordingCheckpoint(taskpoint.Checkpoint(f"file://{out / 'errors-store'}"), events)
    failing = FailingCheckpoint(shared.inner, events) if rank == 0 else shared
    attempt("rank0-store-fails", lambda: state.save_sync(failing, epoch=1))
    bad_extra = {"loss": np.float64(0.5)} if rank == 0 else {"loss": 0.5}
    attempt("rank0-bad-extra", lambda: state.save_sync(shared, epoch=1, extra=bad_extra))
    attempt("good-save", lambda: state.save_sync(shared, epoch=2))
    failing_load = FailingCheckpoint(shared.inner, events) if rank == 1 else shared
    attempt("rank1-load-fails", lambda: state.restore_sync(failing_load))
    attempt("good-restore", lambda: print(rank, state.restore_sync(shared)))
    # Background saves: a failed upload on rank 0 fails every rank's next save.
    attempt("bg-store-fails", lambda: state.save_sync(failing, epoch=3, background=True))
    # A save asked for while that upload still runs would wait behind it (coalesced) and
    # return: let the upload fail first, so the next save is the one that hears of it.
    # Only rank 0 uploads (and fails); rank 1 waits for it in the next save's collective.
    if rank == 0:
        FailingCheckpoint.tried.wait(60)
        time.sleep(0.5)
    attempt("bg-next-save", lambda: state.save_sync(shared, epoch=4, background=True))
    attempt("bg-good-save", lambda: state.save_sync(shared, epoch=5, background=True))
    attempt("bg-wait", lambda: state.wait())
    resumed = state.restore_sync(shared)
    outcomes["bg-restored-epoch"] = str(resumed.epoch if resumed else None)
    (out / f"errors-rank{rank}.json").write_text(json.dumps(outcomes))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    try:
        train(args, rank, restart, out, reference=False)
        train(args, rank, restart, out, reference=True)
        errors(rank, out)
    finally:
        dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()

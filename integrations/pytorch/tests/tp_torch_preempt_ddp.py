"""A DDP worker for the torchrun preemption test (gloo, CPU), outside any taskpoint task.

Usage: TASKPOINT_SAVE_ON_PREEMPTION=1 torchrun --nproc_per_node=2 --max-restarts=1
       tp_torch_preempt_ddp.py URL OUT --term-rank R --term-step S

A step loop (each rank draws its batches, input noise and dropout from its own seeded
RNGs) calls ``state.save_sync(checkpoint, step=step, every=4)`` after every step (and saves
after the last). In the
first incarnation of the group, rank R alone sends itself SIGTERM before step S; every
rank must stop after step S, the preemption save commits, and every rank raises
``taskpoint.Preempted`` (the worker exits non-zero, torchrun restarts the group). The
restarted group resumes and finishes; each rank writes ``OUT/final-rank<R>.pt``, then
trains again without checkpoints and writes ``OUT/reference-rank<R>.pt``. Each rank logs
JSON events to ``OUT/events-rank<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import taskpoint
import torch
import torch.distributed as dist
from taskpoint_pytorch import TaskpointState
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 10


def log(out: Path, rank: int, **event: object) -> None:
    with (out / f"events-rank{rank}.jsonl").open("a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), **event}) + "\n")


def train(args: argparse.Namespace, rank: int, restart: int, out: Path, *, reference: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)
    np.random.seed(100 + rank)
    random.seed(100 + rank)
    state = TaskpointState(ddp, optimizer)
    checkpoint = None if reference else taskpoint.Checkpoint(args.url, keep=20)
    resume = state.restore_sync(checkpoint) if checkpoint is not None else None
    if not reference:
        log(out, rank, event="resume", restart=restart, step=resume.step if resume else None)
    step = resume.step if resume else 0
    while step < STEPS:
        step += 1
        if not reference and restart == 0 and rank == args.term_rank and step == args.term_step:
            log(out, rank, event="sigterm", step=step)
            os.kill(os.getpid(), signal.SIGTERM)
        x = torch.randn(4, 6)
        noise = torch.from_numpy(np.random.normal(0, 0.05, size=(4, 6)).astype(np.float32))
        loss = nn.functional.mse_loss(ddp(x + noise) * (1 + random.uniform(-0.1, 0.1)), x[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if checkpoint is not None:
            try:
                state.save_sync(checkpoint, step=step, every=None if step == STEPS else 4)
            except taskpoint.Preempted as exc:
                log(out, rank, event="preempted", step=step, message=str(exc))
                raise
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
        out / f"{'reference' if reference else 'final'}-rank{rank}.pt",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--term-rank", type=int, default=-1)
    parser.add_argument("--term-step", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    try:
        train(args, rank, restart, out, reference=False)
        train(args, rank, restart, out, reference=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

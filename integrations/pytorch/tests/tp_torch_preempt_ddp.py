"""A DDP worker for the torchrun preemption test (gloo, CPU), outside any taskpoint task.

Usage: TASKPOINT_SAVE_ON_PREEMPTION=1 torchrun --nproc_per_node=2 --max-restarts=1
       tp_torch_preempt_ddp.py URL OUT --term-rank R --term-step S
   or: torchrun --nproc_per_node=2 --max-restarts=1 tp_torch_preempt_ddp.py URL OUT
       --raise-rank R --raise-step S --background [--every N] [--slow-upload SECONDS]

A step loop (each rank draws its batches, input noise and dropout from its own seeded
RNGs) calls ``state.save_sync(checkpoint, step=step, every=4)`` after every step (and saves
after the last). In the
first incarnation of the group, rank R alone sends itself SIGTERM before step S; every
rank must stop after step S, the preemption save commits, and every rank raises
``taskpoint.Preempted`` (the worker exits non-zero, torchrun restarts the group). With
``--raise-rank`` rank R raises an exception before step S instead (torchrun then tears the
other rank down). ``--background`` saves in the background (``blocking=False``), every
``--every`` steps; ``--slow-upload`` makes each upload sleep that long first, in rank 0's
upload thread. The restarted group resumes and finishes; each rank writes
``OUT/final-rank<R>.pt``, then trains again without checkpoints and writes ``OUT/reference-rank<R>.pt``. Each rank logs
JSON events to ``OUT/events-rank<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import taskpoint
import torch
import torch.distributed as dist
from taskpoint_pytorch import TaskpointState
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tp_torch_training import SlowCheckpoint

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
    state = TaskpointState(ddp, optimizer, blocking=not args.background)
    checkpoint: Any = None if reference else taskpoint.Checkpoint(args.url, keep=20)
    if checkpoint is not None and args.slow_upload:
        checkpoint = SlowCheckpoint(checkpoint, args.slow_upload)
    resume = state.restore_sync(checkpoint) if checkpoint is not None else None
    if not reference:
        log(out, rank, event="resume", restart=restart, step=resume.step if resume else None)
    step = resume.step if resume else 0
    while step < STEPS:
        step += 1
        if not reference and restart == 0 and rank == args.term_rank and step == args.term_step:
            log(out, rank, event="sigterm", step=step)
            os.kill(os.getpid(), signal.SIGTERM)
        if not reference and restart == 0 and rank == args.raise_rank and step == args.raise_step:
            log(out, rank, event="raise", step=step)
            raise RuntimeError(f"simulated failure on rank {rank} before step {step}")
        x = torch.randn(4, 6)
        noise = torch.from_numpy(np.random.normal(0, 0.05, size=(4, 6)).astype(np.float32))
        loss = nn.functional.mse_loss(ddp(x + noise) * (1 + random.uniform(-0.1, 0.1)), x[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if checkpoint is not None:
            try:
                state.save_sync(checkpoint, step=step, every=None if step == STEPS else args.every)
            except taskpoint.Preempted as exc:
                log(out, rank, event="preempted", step=step, message=str(exc))
                raise
    if checkpoint is not None:
        state.wait()  # the last background save has committed
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
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--raise-step", type=int, default=-1)
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--slow-upload", type=float, default=0.0)
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

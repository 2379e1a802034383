"""A torchrun worker (gloo, CPU) for timed saves: each rank's clock runs at its own pace.

Usage: torchrun --nproc_per_node=2 tp_torch_interval_worker.py URL OUT

Each rank trains a tiny DDP model for 12 steps and calls
``state.save_sync(checkpoint, step=n, every_s=5)`` after every step, on a fake clock that
says how much time passed: in the first phase rank 1's steps take 10 s and rank 0's 1 s
(rank 1's own clock says a save is due at every step, rank 0's every fifth); in the
second phase, on a fresh state, the other way round. The steps at which each rank's call
saved are written to ``OUT/saves-rank<R>.json``, with the steps at which its own clock
alone would have said due. The process group's timeout is short, so ranks that disagree
fail rather than hang.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import taskpoint
import torch
import torch.distributed as dist
from taskpoint_pytorch import TaskpointState
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 12
EVERY_S = 5.0


class Clock:
    def __init__(self, step_s: float) -> None:
        self.now = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        return self.now


def phase(url: str, rank: int, step_s: float) -> tuple[list[int], list[int]]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TaskpointState(model, optimizer, save_on_preemption=False)
    clock = Clock(step_s)
    state._preemption.schedule.clock = clock  # the test's clock: no sleeping
    checkpoint = taskpoint.Checkpoint(url)
    assert state.restore_sync(checkpoint) is None  # training starts: the time counts from here
    saved, locally_due, since = [], [], 0.0
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        clock.now += clock.step_s
        if clock.now - since >= EVERY_S:
            locally_due.append(step)
        if state.save_sync(checkpoint, step=step, every_s=EVERY_S):
            saved.append(step)
            since = clock.now
    return saved, locally_due


def main() -> None:
    url, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))
    rank = dist.get_rank()
    result = {}
    for name, fast_rank in (("rank1-fast", 1), ("rank0-fast", 0)):
        step_s = 10.0 if rank == fast_rank else 1.0
        saved, locally_due = phase(f"{url}/{name}", rank, step_s)
        result[name] = {"saved": saved, "locally_due": locally_due}
    (out / f"saves-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

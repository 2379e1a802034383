"""One rank of a two-rank torchrun job mirroring its own disk's folder through
:class:`taskpoint.checkpoint.job_mirror.JobMirror` (for tests/test_job_mirror.py).

Usage: torchrun --standalone --nproc_per_node=2 tp_job_mirror_rank.py STORE

Each rank writes into ``disk-<rank>/out`` (two disks), joins, saves its part of step 6 in
the background and waits for it at the end; then joins a second mirror, to another system's
checkpoint. Each rank prints ``rank R: <what> <value>`` lines.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import taskpoint
import torch.distributed as dist
from taskpoint.checkpoint.job_mirror import JobMirror

HANG_S = 300
"""How long a rank waits for the other (which may start much later on a loaded machine):
only a hang reaches it."""


class Plain:
    """Another system's checkpoint object."""

    def save_sync(self, data: object) -> None: ...

    async def save(self, data: object) -> None: ...

    def load_sync(self) -> None: ...

    async def load(self) -> None: ...


def main() -> None:
    store = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("taskpoint").addHandler(handler)

    folder = Path(f"disk-{rank}") / "out"
    folder.mkdir(parents=True)
    (folder / ".taskpoint-part-0-stale").mkdir()  # a killed process's staging folder
    job = JobMirror(taskpoint.Checkpoint(store), timeout=HANG_S)
    nodes = job.join(folder)
    assert nodes is not None and job.join(folder) is nodes  # once
    print(f"rank {rank}: disks {nodes.disks.count} leads {job.leads}")
    print(f"rank {rank}: stale left {sorted(p.name for p in folder.iterdir())}")
    files = {0: ["model.bin", "rng_state_0.pth"], 1: ["rng_state_1.pth"]}[rank]
    for name in files:
        (folder / "checkpoint-6").mkdir(exist_ok=True)
        (folder / "checkpoint-6" / name).write_text(f"{name} from rank {rank}")
    job.save_parts(folder, step=6)  # in the background
    print(f"rank {rank}: gathered {job.gather(rank)}")
    print(f"rank {rank}: finished {job.finish(HANG_S, leader=rank == 0)}")
    print(f"rank {rank}: staging left {sorted(p.name for p in folder.iterdir())}")

    other = JobMirror(Plain(), timeout=HANG_S)
    print(f"rank {rank}: plain nodes {other.join(folder)} leads {other.leads}")
    print(f"rank {rank}: warnings {len(warnings)}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

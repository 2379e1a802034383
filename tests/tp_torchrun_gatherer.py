"""One rank of a torchrun job gathering before any process group (for
tests/test_torch_coordination.py).

Usage: torchrun --standalone --nproc_per_node=2 tp_torchrun_gatherer.py MODE

``MODE`` ``ok``: every rank gathers twice through :func:`torch_job_coordinator` (a
:class:`TorchrunCoordinator`), checks that the first round's keys are gone from the store,
then starts a gloo process group, gathers once through a :class:`TorchCoordinator` and
closes it, then ors a flag set on rank 1 only through an :class:`AnyRank`. ``missing``: rank 1 exits at once; rank 0 gathers with a 3 s timeout. Each rank
prints ``rank R: <result>`` lines.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist
from taskpoint import CheckpointCoordinationError
from taskpoint.distributed.torch_coordination import (
    AnyRank,
    TorchCoordinator,
    TorchrunCoordinator,
    torch_job_coordinator,
)

HANG_S = 300
"""How long a gather waits for the other rank (which may start much later on a loaded
machine): only a hang reaches it."""


def main() -> None:
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    if mode == "missing":
        if rank == 1:
            return
        coord = TorchrunCoordinator(timeout=3)
        started = time.monotonic()
        try:
            coord.all_gather({"rank": rank})
        except CheckpointCoordinationError as exc:
            took = time.monotonic() - started
            own = f"{coord._prefix}/0/{rank}"
            gone = not coord._store.check([own])
            print(f"rank {rank}: missing {exc.ranks} after {took:.1f}s own record gone {gone}")
            print(f"rank {rank}: message {exc}", flush=True)
        return

    coord = torch_job_coordinator(timeout=HANG_S)
    assert isinstance(coord, TorchrunCoordinator), coord
    print(f"rank {rank}: gathered {coord.all_gather({'rank': rank, 'pid': os.getpid()})}")
    print(f"rank {rank}: gathered {coord.all_gather(f'second from {rank}')}")
    first = [f"{coord._prefix}/0/{r}" for r in range(2)] + [f"{coord._prefix}/0/read"]
    print(f"rank {rank}: first round gone {not any(coord._store.check([k]) for k in first)}")
    coord.close()

    dist.init_process_group("gloo")
    groups = len(dist.distributed_c10d._world.pg_map)
    grouped = torch_job_coordinator(timeout=HANG_S)
    assert isinstance(grouped, TorchCoordinator), grouped
    print(f"rank {rank}: grouped {grouped.all_gather(rank)}")
    grouped.close()
    grouped.close()
    vote = AnyRank(timeout=HANG_S)  # a SIGTERM that reached rank 1 only stops both
    print(f"rank {rank}: any rank {vote(rank == 1)} {vote(False)}")
    vote.close()
    print(f"rank {rank}: groups after close {len(dist.distributed_c10d._world.pg_map) - groups}")
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()

"""A torchrun worker for the DCP conformance tests (gloo, CPU).

Usage: torchrun --nproc_per_node=N tp_torch_dcp_worker.py MODE URL OUT

Modes (each rank writes what it saw to ``OUT/<mode>-<world size>-rank<R>.json``):

``save``
    Saves, through :class:`TaskpointStorageWriter`, a DTensor sharded ``Shard(0)`` over the
    ranks (``GLOBAL``, rows split) beside a plain tensor every rank holds alike (DCP writes
    it from rank 0 alone), then loads it back on the same ranks with the DTensor placed
    ``Replicate()`` and then ``Shard(1)``. Then saves, to ``URL-replicated``, one plain
    tensor every rank holds alike: DCP has one rank write it, and the other an empty shard
    file; it loads back.
``load``
    Loads the first save on this world size, with the DTensor placed ``Replicate()`` and
    ``Shard(1)``, and a plain tensor instead of a DTensor.

Each JSON holds, per check, the full tensor after the load (as a list) or the error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import taskpoint
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from taskpoint_pytorch import TaskpointStorageReader, TaskpointStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

GLOBAL = torch.arange(24, dtype=torch.float32).reshape(4, 6)
"""The DTensor's full value: 4 rows (2 per rank on 2 ranks), 6 columns (3 per rank)."""
PLAIN = torch.linspace(-1.0, 1.0, 5)


def full(value: Any) -> list[Any]:
    """The whole tensor behind ``value`` (a DTensor is gathered), as nested lists."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.tolist()  # type: ignore[no-any-return]


def save(url: str, state: dict[str, Any]) -> str:
    dcp.save(state, storage_writer=TaskpointStorageWriter(taskpoint.Checkpoint(url)))
    return "ok"


def load(url: str, state: dict[str, Any]) -> dict[str, Any]:
    dcp.load(state, storage_reader=TaskpointStorageReader(taskpoint.Checkpoint(url)))
    return {key: full(value) for key, value in state.items()}


def main() -> None:
    mode, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    seen: dict[str, Any] = {}

    def check(name: str, fn: Any) -> None:
        try:
            seen[name] = fn()
        except Exception as exc:  # recorded for the test to show
            seen[name] = f"{type(exc).__name__}: {exc}"

    def target(*placements: Any) -> dict[str, Any]:
        return {
            "dtensor": distribute_tensor(torch.zeros_like(GLOBAL), mesh, list(placements)),
            "plain": torch.zeros_like(PLAIN),
        }

    try:
        if mode == "save":
            state = {"dtensor": distribute_tensor(GLOBAL, mesh, [Shard(0)]), "plain": PLAIN}
            check("save", lambda: save(url, state))
            check("replicate", lambda: load(url, target(Replicate())))
            check("shard1", lambda: load(url, target(Shard(1))))
            replicated = f"{url}-replicated"
            check("replicated-save", lambda: save(replicated, {"a": PLAIN * 2}))
            check("replicated-load", lambda: load(replicated, {"a": torch.zeros_like(PLAIN)}))
        else:
            check("replicate", lambda: load(url, target(Replicate())))
            check("shard1", lambda: load(url, target(Shard(1))))
            check("tensor", lambda: load(
                url, {"dtensor": torch.zeros_like(GLOBAL), "plain": torch.zeros_like(PLAIN)}
            ))
        (out / f"{mode}-{world}-rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The few collective operations the adapter needs, as no-ops outside a process group."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["Ranks", "all_gather_object", "barrier", "current_ranks"]


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the job.

    Attributes:
        rank: the global rank, from 0.
        local_rank: the rank on this node, from 0.
        world_size: how many processes train together.
        grouped: whether a ``torch.distributed`` process group links them.
    """

    rank: int
    local_rank: int
    world_size: int
    grouped: bool


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def current_ranks() -> Ranks:
    """This process's ranks, from the process group when one is up, else the launcher's
    environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``)."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        return Ranks(rank, _env_int("LOCAL_RANK", rank), dist.get_world_size(), True)
    rank = _env_int("RANK", 0)
    return Ranks(rank, _env_int("LOCAL_RANK", rank), _env_int("WORLD_SIZE", 1), False)


def barrier() -> None:
    """Wait for every rank, when a process group of more than one process is up."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order; ``[obj]`` without a process group."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered

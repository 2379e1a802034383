"""The few ``torch.distributed`` collectives a state bundle needs, on the default group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["all_gather", "broadcast_from_zero", "is_distributed", "rank_and_size"]


def is_distributed() -> bool:
    """Whether a default process group of more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_size() -> tuple[int, int]:
    """This process's global rank and the world size; ``(0, 1)`` outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (a collective: all ranks must call it)."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_from_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank; also a barrier, since rank 0 sends it last."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]

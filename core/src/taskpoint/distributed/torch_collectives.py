"""Which rank this process is, and the few collectives the adapters make on the default
``torch.distributed`` process group: one set, shared by every adapter.

Outside a process group of several ranks each is the one-rank case (a gather returns
``[value]``, a barrier returns at once), so an adapter calls them the same way in a
single process and under ``torchrun``. torch is imported on first use: core never
depends on it, and without torch every process is a lone rank 0 (:func:`current_ranks`
still reads the launcher's variables).

Unlike a :class:`taskpoint.Coordinator`, these run on the default group with its own
timeout: they are for steps every rank reaches together (a save the framework calls on
every rank), where a coordinator's gloo group or store would only add a hop.

Example (every rank, at the same point)::

    from taskpoint.distributed import current_ranks, gather_or_raise

    error = None
    try:
        summary = restore_my_shard()
    except Exception as exc:
        error, summary = exc, None
    # every rank raises if any failed; else every rank's summary, in rank order
    summaries = gather_or_raise(summary, error, "restore the state")
    if current_ranks().rank == 0:
        report(summaries)
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from taskpoint.errors import CheckpointCoordinationError, CheckpointError

__all__ = [
    "Ranks",
    "all_gather_object",
    "barrier",
    "broadcast_from_zero",
    "current_ranks",
    "describe_error",
    "gather_or_raise",
    "is_distributed",
    "raise_first_failure",
    "rank_and_size",
]


def _group() -> Any | None:
    """``torch.distributed`` when its default process group is up; ``None`` without one
    (or without torch)."""
    try:
        dist = importlib.import_module("torch.distributed")
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _several() -> Any | None:
    """``torch.distributed`` when a default process group of more than one rank is up."""
    dist = _group()
    return dist if dist is not None and dist.get_world_size() > 1 else None


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the job.

    Attributes:
        rank: the global rank, from 0.
        local_rank: the rank on this node, from 0.
        world_size: how many processes train together.
        grouped: whether a ``torch.distributed`` process group links them (else the
            values come from the launcher's environment variables).
    """

    rank: int
    local_rank: int
    world_size: int
    grouped: bool


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def current_ranks() -> Ranks:
    """This process's ranks: from the default process group when one is up, else from
    the launcher's environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``; a
    variable that is unset or not a number counts as rank 0 of 1, the local rank as the
    rank)."""
    dist = _group()
    if dist is not None:
        rank = int(dist.get_rank())
        return Ranks(rank, _env_int("LOCAL_RANK", rank), int(dist.get_world_size()), True)
    rank = _env_int("RANK", 0)
    return Ranks(rank, _env_int("LOCAL_RANK", rank), _env_int("WORLD_SIZE", 1), False)


def rank_and_size() -> tuple[int, int]:
    """This process's global rank and the world size of the default process group;
    ``(0, 1)`` without one (the launcher's variables are not read: without a group, no
    collective reaches the other processes)."""
    dist = _group()
    if dist is None:
        return 0, 1
    return int(dist.get_rank()), int(dist.get_world_size())


def is_distributed() -> bool:
    """Whether a default process group of more than one rank is up."""
    return _several() is not None


def barrier() -> None:
    """Wait for every rank of the default process group; nothing without one."""
    dist = _several()
    if dist is not None:
        dist.barrier()


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value`` (any picklable object), in rank order; ``[value]`` without
    a process group of several ranks. A collective: every rank must call it."""
    dist = _several()
    if dist is None:
        return [value]
    gathered: list[Any] = [None] * int(dist.get_world_size())
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_from_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the others' is ignored); ``value`` without a
    process group of several ranks. A collective, and a barrier too: rank 0 sends last."""
    dist = _several()
    if dist is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def describe_error(exc: BaseException | None) -> str | None:
    """``exc`` as ``"Type: message"``, to send to the other ranks; ``None`` for no error."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def raise_first_failure(
    local: BaseException | None,
    messages: list[str | None],
    what: str,
    *,
    failure: type[CheckpointError] = CheckpointCoordinationError,
) -> None:
    """Raise this rank's own error, else one naming the first rank that failed.

    Args:
        local: this rank's error, or ``None``.
        messages: every rank's :func:`describe_error`, in rank order.
        what: what failed, for the message (``"save the state"``).
        failure: the error raised for another rank's failure (an adapter's own subclass
            of :class:`taskpoint.CheckpointError`); a
            :class:`~taskpoint.CheckpointCoordinationError` names the rank in ``ranks``.

    Raises:
        Exception: ``local``; else ``failure`` (``"cannot <what>: rank <r> failed
            (<its error>), so every rank stops"``) when a message is not ``None``.
    """
    if local is not None:
        raise local
    for rank, message in enumerate(messages):
        if message is None:
            continue
        text = f"cannot {what}: rank {rank} failed ({message}), so every rank stops"
        if issubclass(failure, CheckpointCoordinationError):
            raise failure(text, ranks=[rank])
        raise failure(text)


def gather_or_raise(
    value: Any,
    error: BaseException | None,
    what: str,
    *,
    failure: type[CheckpointError] = CheckpointCoordinationError,
) -> list[Any]:
    """Every rank's ``value``, in rank order, once no rank has an ``error``: the agreement
    that keeps a rank from going on (into a collective the others never reach) after
    another failed. A collective (:func:`all_gather_object`): every rank must call it,
    error or not.

    Raises:
        Exception: as :func:`raise_first_failure`, on every rank, when any rank's
            ``error`` is set.
    """
    gathered = all_gather_object((value, describe_error(error)))
    raise_first_failure(error, [message for _, message in gathered], what, failure=failure)
    return [item for item, _ in gathered]

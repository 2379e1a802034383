"""How the ranks of a job agree before any goes on: every rank's outcome is gathered, and
when one failed, every rank raises (its own error, or a ``StateError`` naming the first
failed rank), so no rank is left waiting in a collective the others never reach.

Every function here is a collective under ``torch.distributed``: all ranks must call it.
Outside a process group each is the one-rank case.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from taskpoint.checkpoint.mirror import settle_uploads

from taskpoint_pytorch._arguments import check_counter, check_extra
from taskpoint_pytorch._distributed import all_gather
from taskpoint_pytorch._errors import StateError
from taskpoint_pytorch._rng import capture_rng

__all__ = [
    "agree_to_save",
    "describe_error",
    "gather_or_raise",
    "raise_first_failure",
    "settle_every_rank",
]


def describe_error(exc: BaseException | None) -> str | None:
    """``exc`` as ``"Type: message"`` to send to the other ranks; ``None`` for no error."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def raise_first_failure(local: BaseException | None, messages: list[str | None], what: str) -> None:
    """Raise this rank's own error, else a ``StateError`` naming the first failed rank.

    Args:
        local: this rank's error, or ``None``.
        messages: every rank's :func:`describe_error`, in rank order.
        what: what failed, for the message (``"save the state"``).

    Raises:
        Exception: ``local``; else :class:`StateError` when a message is not ``None``.
    """
    if local is not None:
        raise local
    for rank, message in enumerate(messages):
        if message is not None:
            raise StateError(f"cannot {what}: rank {rank} failed ({message}), so every rank stops")


def gather_or_raise(value: Any, error: Exception | None, what: str) -> list[Any]:
    """Every rank's ``value``, in rank order, once no rank has an ``error``.

    Raises:
        Exception: as :func:`raise_first_failure`, when any rank's ``error`` is set.
    """
    gathered = all_gather((value, describe_error(error)))
    raise_first_failure(error, [message for _, message in gathered], what)
    return [item for item, _ in gathered]


def agree_to_save(
    prepare: Callable[[], None],
    epoch: int,
    step: int,
    extra: Mapping[str, Any] | None,
    rng: bool,
) -> tuple[int, int, dict[str, Any], list[dict[str, Any] | None]]:
    """Every rank: run ``prepare``, check the counters and ``extra``, capture this
    rank's RNG state (with ``rng``), and gather them all.

    Returns:
        The checked epoch, step and extra state, and every rank's RNG state in rank
        order (``None`` entries without ``rng``).

    Raises:
        Exception: what ``prepare`` or a check raised here, or :class:`StateError`
            when another rank failed: every rank raises, none goes on to save.
    """
    local_error: Exception | None = None
    rng_state: dict[str, Any] | None = None
    extra_state: dict[str, Any] = {}
    try:
        prepare()
        epoch = check_counter("epoch", epoch)
        step = check_counter("step", step)
        extra_state = check_extra(extra)
        # After the checks (they draw no random numbers), before anything that could.
        rng_state = capture_rng() if rng else None
    except Exception as exc:
        local_error = exc
    rng_states = gather_or_raise(rng_state, local_error, "save the state")
    return epoch, step, extra_state, rng_states


def settle_every_rank() -> None:
    """Wait for this process's uploads still in flight (an earlier attempt's too), then for
    every rank's: only rank 0 uploads, and a rank that loaded before rank 0's last commit
    landed would restore an older checkpoint than rank 0."""
    settle_uploads()
    all_gather(None)

"""How the ranks of a job agree before any goes on: a save's checks (each raising
``TypeError``/``ValueError`` naming the argument) and RNG capture, gathered with core's :func:`taskpoint.distributed.gather_or_raise` (every rank raises its
own error, or a ``StateError`` naming the first failed rank, so no rank is left waiting in
a collective the others never reach), and the wait for every rank's uploads.

Every function here is a collective under ``torch.distributed``: all ranks must call it.
Outside a process group each is the one-rank case.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from taskpoint.integration import all_gather_object, gather_or_raise, settle_uploads

from taskpoint_pytorch._errors import StateError
from taskpoint_pytorch._rng import capture_rng

__all__ = ["agree_to_save", "settle_every_rank"]


def agree_to_save(
    prepare: Callable[[], None],
    epoch: int,
    step: int,
    extra: Mapping[str, Any] | None,
    rng: bool,
) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    """Every rank: run ``prepare``, check the counters and ``extra``, capture this
    rank's RNG state (with ``rng``), and gather them all.

    Returns:
        The checked extra state (a new dict; empty for ``None``), and every rank's RNG
        state in rank order (``None`` entries without ``rng``).

    Raises:
        ValueError: (on this rank) a counter is not a non-negative int.
        TypeError: (on this rank) ``extra`` is not a mapping, or a key of it not a string.
        Exception: what ``prepare`` or a check raised here, or :class:`StateError`
            when another rank failed: every rank raises, none goes on to save.
    """
    local_error: Exception | None = None
    rng_state: dict[str, Any] | None = None
    extra_state: dict[str, Any] = {}
    try:
        prepare()
        for name, value in (("epoch", epoch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int; got {value!r}")
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(
                f"extra must be a mapping of str keys to values; got {type(extra).__name__}"
            )
        extra_state = dict(extra or {})
        for key in extra_state:
            if not isinstance(key, str):
                raise TypeError(f"extra keys must be strings; got {key!r}")
        # After the checks (they draw no random numbers), before anything that could.
        rng_state = capture_rng() if rng else None
    except Exception as exc:
        local_error = exc
    rng_states = gather_or_raise(rng_state, local_error, "save the state", failure=StateError)
    return extra_state, rng_states


def settle_every_rank() -> None:
    """Wait for this process's uploads still in flight (an earlier attempt's too), then for
    every rank's: only rank 0 uploads, and a rank that loaded before rank 0's last commit
    landed would restore an older checkpoint than rank 0."""
    settle_uploads()
    all_gather_object(None)

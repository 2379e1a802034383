"""The checks on a save's or restore's arguments, run on every rank before the ranks agree.

Each raises ``TypeError`` or ``ValueError`` naming the argument and what it got, as
``TaskpointState``'s docstrings promise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from taskpoint import Checkpoint, CheckpointLike

__all__ = ["check_checkpoint", "check_counter", "check_extra", "check_sharded_checkpoint"]


def check_counter(name: str, value: object) -> int:
    """``value``, checked to be a non-negative int (not a bool).

    Raises:
        ValueError: it is not; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int; got {value!r}")
    return value


def check_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """A save's ``extra`` as a new dict (empty for ``None``).

    Raises:
        TypeError: it is not a mapping, or a key is not a string.
    """
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping of str keys to values; got {type(extra).__name__}")
    for key in extra:
        if not isinstance(key, str):
            raise TypeError(f"extra keys must be strings; got {key!r}")
    return dict(extra)


def check_checkpoint(checkpoint: object) -> None:
    """Check ``checkpoint`` is checkpoint-like.

    Raises:
        TypeError: it is not (with a hint where it is ``None``, as
            ``taskpoint.ctx().checkpoint`` is without checkpoints).
    """
    if not isinstance(checkpoint, CheckpointLike):
        hint = (
            " (taskpoint.ctx().checkpoint is None when the task's environment has "
            "checkpoints=False, and outside a task)"
            if checkpoint is None
            else ""
        )
        raise TypeError(
            "checkpoint must be a taskpoint.Checkpoint or another object with save, "
            f"save_sync, load and load_sync; got {type(checkpoint).__name__}{hint}"
        )


def check_sharded_checkpoint(checkpoint: object) -> None:
    """Check ``checkpoint`` is a :class:`taskpoint.Checkpoint`, as sharded state needs.

    Raises:
        TypeError: it is not.
    """
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(
            "TaskpointState(sharded=True) saves through torch.distributed.checkpoint, every "
            "rank uploading its own shards, so it needs a taskpoint.Checkpoint; got "
            f"{type(checkpoint).__name__}"
        )

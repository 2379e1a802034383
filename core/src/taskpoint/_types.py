"""The checkpoint protocol adapters type against."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckpointLike", "check_checkpoint_like"]


@runtime_checkable
class CheckpointLike(Protocol):
    """Anything with taskpoint's checkpoint methods: a :class:`taskpoint.Checkpoint`, or
    another system's checkpoint object with the same four methods (Flyte's, for one).

    ``save``/``save_sync`` take raw bytes or a file or directory path; ``load``/``load_sync``
    return the restored local path, or ``None`` when nothing was saved before.
    """

    async def save(self, data: Any, /) -> None: ...

    def save_sync(self, data: Any, /) -> None: ...

    async def load(self) -> Path | None: ...

    def load_sync(self) -> Path | None: ...


def check_checkpoint_like(checkpoint: object, owner: str) -> CheckpointLike:
    """``checkpoint``, once it is a :class:`CheckpointLike`: the check every adapter makes
    of the checkpoint it is given (``owner`` names the adapter's class or function).

    Raises:
        TypeError: it lacks the checkpoint methods; for ``None``, the message says where
            ``taskpoint.ctx().checkpoint`` is ``None``.
    """
    if isinstance(checkpoint, CheckpointLike):
        return checkpoint
    hint = (
        " (taskpoint.ctx().checkpoint is None when the task's environment has "
        "checkpoints=False, and taskpoint.ctx() is None outside a task; pass "
        "taskpoint.Checkpoint(url) instead)" if checkpoint is None else ""
    )
    raise TypeError(
        f"{owner} takes a checkpoint with save, save_sync, load and load_sync (a "
        "taskpoint.Checkpoint, taskpoint.ctx().checkpoint or another CheckpointLike) as its "
        f"first argument; got {type(checkpoint).__name__}{hint}"
    )

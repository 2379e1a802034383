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


def check_checkpoint_like(checkpoint: object) -> None:
    """Raise ``TypeError`` unless ``checkpoint`` is :class:`CheckpointLike` (the check an
    adapter makes of the checkpoint it is given), with a hint where it is ``None``.

    Raises:
        TypeError: it is not; the message names what it got.
    """
    if not isinstance(checkpoint, CheckpointLike):
        hint = (
            " (taskpoint.ctx().checkpoint is None when the task's environment has "
            "checkpoints=False, and taskpoint.ctx() is None outside a task)"
            if checkpoint is None
            else ""
        )
        raise TypeError(
            "checkpoint must be a taskpoint.Checkpoint or another object with save, "
            f"save_sync, load and load_sync; got {type(checkpoint).__name__}{hint}"
        )

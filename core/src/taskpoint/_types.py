"""The checkpoint protocol adapters type against."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckpointLike"]


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

"""Lightning's ``OnExceptionCheckpoint`` next to ``TaskpointModelCheckpoint``: it saves from
its ``on_exception`` (no ``ModelCheckpoint`` save method sees it) and deletes the file at
``teardown``. So the callback moves every one saving into its ``dirpath`` just before
itself in ``trainer.callbacks``, mirrors the folder when one of their files changed, and
again at teardown when one was deleted; one saving elsewhere is named in a WARNING.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from taskpoint_lightning._compat import loaded_classes

__all__ = ["ExceptionFiles"]

log = logging.getLogger(__name__)

def _ckpt_path(callback: Any) -> str:
    path: str = os.fspath(callback.ckpt_path)
    return path


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), folder]) == folder


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


class ExceptionFiles:
    """The files of the ``OnExceptionCheckpoint`` callbacks that save into ``dirpath``,
    and whether they changed since the folder was last mirrored.

    Args:
        paths: their checkpoint files.
    """

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self._seen = self._state()

    @classmethod
    def find(cls, trainer: Any, owner: Any, dirpath: str) -> ExceptionFiles:
        """The ``OnExceptionCheckpoint`` callbacks of ``trainer`` (a Lightning ``Trainer``)
        that save into ``dirpath``, moved before ``owner`` in ``trainer.callbacks`` (a new
        list: Lightning may be going through the old one), so their ``on_exception`` runs
        first."""
        types = loaded_classes("callbacks", "OnExceptionCheckpoint")
        callbacks: list[Any] = list(trainer.callbacks)  # (set by Lightning, not declared)
        if not types or owner not in callbacks:
            return cls([])
        folder = os.path.realpath(dirpath)
        ours: list[Any] = []
        for callback in callbacks:
            if not isinstance(callback, types):
                continue
            path = _ckpt_path(callback)
            if _inside(path, folder):
                ours.append(callback)
            elif trainer.is_global_zero:
                log.warning(
                    "OnExceptionCheckpoint saves to %s, outside %s: that save is not "
                    "mirrored to the store; give it dirpath=%r, or use "
                    "TaskpointModelCheckpoint(save_on_exception=True)", path, dirpath, dirpath,
                )
        if any(callbacks.index(c) > callbacks.index(owner) for c in ours):
            rest = [c for c in callbacks if all(c is not o for o in ours)]
            at = rest.index(owner)
            trainer.callbacks = [*rest[:at], *ours, *rest[at:]]
        return cls([_ckpt_path(c) for c in ours])

    def _state(self) -> tuple[int | None, ...]:
        return tuple(_mtime(path) for path in self.paths)

    def changed(self) -> bool:
        """Whether a file was written or deleted since :meth:`mirrored` (or creation)."""
        return bool(self.paths) and self._state() != self._seen

    def mirrored(self) -> None:
        """Note the files as the mirror just started holds them."""
        self._seen = self._state()

"""Saves by training time (``train_time_interval``): a ``timedelta``, ``"auto"`` or a
:class:`taskpoint.SaveInterval`, checked at every step boundary in automatic and manual
optimization alike (``ModelCheckpoint``'s own check runs in automatic optimization only).
Global rank zero's clock decides (one ``strategy.broadcast`` per step boundary). Every
save the callback makes is timed as training sees it (the hook's seconds) and restarts the
interval; the background upload is measured by the interval itself, until its commit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from taskpoint import SaveInterval
from taskpoint.integration import TimedSaves as _TimedSaves

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TimeInterval", "TimedSaves", "check_time_interval"]

TimeInterval = timedelta | Literal["auto"] | SaveInterval
"""What ``train_time_interval`` accepts."""


def check_time_interval(value: object, owner: str, kwargs: dict[str, Any]) -> TimeInterval | None:
    """``value`` if ``train_time_interval`` accepts it beside ``ModelCheckpoint``'s other
    ``kwargs``.

    Raises:
        TypeError: it is neither ``None``, a ``timedelta``, ``"auto"`` nor a
            :class:`taskpoint.SaveInterval`.
        ValueError: a ``timedelta`` that is not positive; ``every_n_train_steps`` or
            ``every_n_epochs`` set as well (as in ``ModelCheckpoint``).
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(
                f"{owner}: train_time_interval must be a positive timedelta; got {value!r} "
                "(to save at every step, use every_n_train_steps=1)"
            )
    elif not (value is None or value == "auto" or isinstance(value, SaveInterval)):
        raise TypeError(
            f"{owner}: train_time_interval takes a datetime.timedelta, \"auto\" (an interval "
            "chosen from the save's cost and the run's failures) or a taskpoint.SaveInterval; "
            f"got {value!r}"
        )
    for name in ("every_n_train_steps", "every_n_epochs"):
        if value is not None and kwargs.get(name):
            raise ValueError(
                f"{owner}: train_time_interval={value!r} and {name}={kwargs[name]!r} are "
                "mutually exclusive (as in Lightning's ModelCheckpoint): save by time or by count"
            )
    return value


class TimedSaves(_TimedSaves):
    """Core's timed saves (``spec``: ``train_time_interval``; ``None``: no timed saves, none
    measured), copied as settings, and measured across Lightning's hooks."""

    def __init__(self, spec: TimeInterval | None) -> None:
        super().__init__(spec)
        self.mirrors = 0  # mirrors started, and whether the newest uploads in the background
        self._background = False

    def __getstate__(self) -> dict[str, object]:
        """A copy (a spawned worker's) makes its own interval at setup, listening to its own
        checkpoint; one the user made travels as it is."""
        interval = self.interval if isinstance(self.spec, SaveInterval) else None
        return {"spec": self.spec, "interval": interval, "mirrors": 0, "_background": False}

    def __eq__(self, other: object) -> bool:
        """Equal settings: what a pickled or deep-copied callback carries is equal."""
        if not isinstance(other, TimedSaves):
            return NotImplemented
        return self.__getstate__() == other.__getstate__()

    def key(self) -> timedelta | str | None:
        """What the callback's ``state_key`` names the setting by: the ``timedelta``, or
        ``"auto"`` / ``"SaveInterval"`` (stable while the chosen interval changes)."""
        spec = self.spec
        return "SaveInterval" if isinstance(spec, SaveInterval) else spec  # type: ignore[return-value]

    def due_on(self, trainer: pl.Trainer) -> bool:
        """At a step boundary: whether a timed save is due, global rank zero's answer on
        every rank (one broadcast; every rank must call this)."""
        return self.due(lambda due: bool(trainer.strategy.broadcast(due, src=0)))

    def mirror_started(self, *, background: bool) -> None:
        """A mirror of the folder started; ``background``: a background save through the
        checkpoint, whose commit the interval hears of."""
        self.mirrors += 1
        self._background = background

    @contextmanager
    def measured(self, trainer: pl.Trainer, saved: Callable[[], Hashable]) -> Iterator[None]:
        """Time the block; when ``saved()`` changed across it (Lightning saved, or a mirror
        started), tell the interval what training waited, and whether an upload goes on
        in the background until its commit; on global rank zero, log the interval then in
        force to the Trainer's loggers (``taskpoint/interval_s``, and for ``"auto"`` its
        inputs: :meth:`taskpoint.IntervalChoice.metrics`)."""
        interval = self.interval
        if interval is None:
            yield
            return
        before, mirrors, began = saved(), self.mirrors, time.monotonic()
        yield
        if saved() == before:
            return
        background = self.mirrors != mirrors and self._background
        self.saved(blocked_s=time.monotonic() - began, background=background)
        if trainer.is_global_zero:
            metrics = interval.choice.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

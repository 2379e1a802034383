"""Saves by training time for :class:`~taskpoint_lightning.TaskpointModelCheckpoint`.

``ModelCheckpoint``'s ``train_time_interval`` is a ``timedelta`` checked in its automatic
optimization path only (a ``LightningModule`` with ``automatic_optimization = False`` never
saves on time). The callback takes the knob over: a ``timedelta``, ``"auto"`` (Young/Daly
from the measured save cost and the run's failures, :class:`taskpoint.SaveInterval`), or a
:class:`taskpoint.SaveInterval` of the user's own, checked at every step boundary in
automatic and manual optimization alike. Global rank zero's clock decides: one broadcast
through the strategy per step boundary, so every rank saves at the same step.

Every save the callback makes (timed, ``every_n_train_steps``, epoch or validation end) is
timed as training sees it (the hook's seconds, the snapshot for the upload included) and
restarts the interval; the upload running in the background is measured by the
:class:`taskpoint.SaveInterval` itself, which listens to the checkpoint's commits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

from taskpoint import CheckpointLike, SaveInterval

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TimeInterval", "TimedSaves", "check_time_interval"]

TimeInterval = timedelta | Literal["auto"] | SaveInterval
"""What ``train_time_interval`` accepts."""


def check_time_interval(value: object, owner: str) -> TimeInterval | None:
    """``value`` if ``train_time_interval`` accepts it.

    Raises:
        TypeError: it is neither ``None``, a ``timedelta``, ``"auto"`` nor a
            :class:`taskpoint.SaveInterval`.
        ValueError: a ``timedelta`` that is not positive.
    """
    if value is None or value == "auto" or isinstance(value, SaveInterval):
        return value
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(
                f"{owner}: train_time_interval must be a positive timedelta; got {value!r} "
                "(to save at every step, use every_n_train_steps=1)"
            )
        return value
    raise TypeError(
        f"{owner}: train_time_interval takes a datetime.timedelta, \"auto\" (an interval "
        "chosen from the save's cost and the run's failures) or a taskpoint.SaveInterval; "
        f"got {value!r}"
    )


class TimedSaves:
    """The callback's time-based saves: the :class:`taskpoint.SaveInterval` made at setup
    from ``train_time_interval``, the decision at each step boundary, and the measurement of
    each save.

    Args:
        spec: ``train_time_interval`` (checked by :func:`check_time_interval`); ``None``:
            no timed saves, and saves are not measured.
    """

    def __init__(self, spec: TimeInterval | None) -> None:
        self.spec = spec
        self.interval: SaveInterval | None = spec if isinstance(spec, SaveInterval) else None
        self.mirrors = 0  # mirrors started, and whether the newest uploads in the background
        self._background = False

    def __getstate__(self) -> dict[str, object]:
        """A copy (a spawned worker's) makes its own interval at setup, listening to its own
        checkpoint; one the user made travels as it is."""
        interval = self.interval if isinstance(self.spec, SaveInterval) else None
        return {"spec": self.spec, "interval": interval, "mirrors": 0, "_background": False}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)

    def __eq__(self, other: object) -> bool:
        """Equal settings: what a pickled or deep-copied callback carries is equal."""
        if not isinstance(other, TimedSaves):
            return NotImplemented
        return self.__getstate__() == other.__getstate__()

    __hash__ = None  # type: ignore[assignment]

    def key(self) -> timedelta | str | None:
        """What the callback's ``state_key`` names the setting by: the ``timedelta``, or
        ``"auto"`` / ``"SaveInterval"`` (stable while the chosen interval changes)."""
        if isinstance(self.spec, SaveInterval):
            return "SaveInterval"
        return self.spec

    def start(self, checkpoint: CheckpointLike) -> None:
        """Make the interval (once) with ``SaveInterval.for_checkpoint``: a
        :class:`taskpoint.Checkpoint`'s attempt history and uploads' commits (another
        system's checkpoint: the prior and the time blocked)."""
        if self.interval is not None or self.spec is None or isinstance(self.spec, SaveInterval):
            return
        every: float | Literal["auto"] = (
            "auto" if self.spec == "auto" else self.spec.total_seconds()
        )
        self.interval = SaveInterval.for_checkpoint(checkpoint, every)

    def due(self, trainer: pl.Trainer) -> bool:
        """At a step boundary: count the step and say whether a timed save is due, global
        rank zero's answer on every rank (one broadcast; every rank must call this)."""
        interval = self.interval
        if interval is None:
            return False
        interval.step_done()

        def agree(due: bool) -> bool:
            return bool(trainer.strategy.broadcast(due, src=0))

        return interval.due(agree=agree)

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
        interval.saved(blocked_s=max(0.0, time.monotonic() - began), background=background)
        if trainer.is_global_zero:
            metrics = interval.choice.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

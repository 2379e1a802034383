"""Saves by training time for :class:`~taskpoint_hf.TaskpointTrainerCallback`.

``TrainingArguments`` count saves in steps or epochs (``save_strategy``, ``save_steps``).
``save_every_s`` adds saves by time: a number of seconds, ``"auto"`` (Young/Daly from the
measured save cost and the run's failures, :class:`taskpoint.SaveInterval`) or a
:class:`taskpoint.SaveInterval` of the user's own. At each step end the callback asks the
interval and, when a save is due, sets ``control.should_save``, so the Trainer writes its
own ``checkpoint-N`` there (and the callback uploads it, as any other). World process
zero's clock decides: one broadcast per step, so every rank saves at the same step.

Every save the Trainer makes (timed or its own) is measured as training sees it, from the
step's end (or the log and evaluation before the save, which would run anyway) to the end of
``on_save`` (the Trainer's write and the upload's start), and restarts the interval; an
upload running in the background is measured by the interval itself, until its commit.
"""

from __future__ import annotations

import time
from typing import Literal

from taskpoint import CheckpointLike, SaveInterval
from taskpoint.integration import broadcast_from_zero, check_every
from transformers import TrainerControl

__all__ = ["SaveEvery", "TimedSaves", "check_save_every"]

SaveEvery = float | Literal["auto"] | SaveInterval
"""What ``save_every_s`` accepts."""


def check_save_every(value: object) -> SaveEvery | None:
    """``value`` if ``save_every_s`` accepts it (seconds as a ``float``).

    Raises:
        ValueError: it is neither ``None``, a positive finite number of seconds, ``"auto"``
            nor a :class:`taskpoint.SaveInterval`.
    """
    if value is None or isinstance(value, SaveInterval):
        return value
    try:
        return check_every(value, "save_every_s")
    except ValueError as exc:
        raise ValueError(f"{exc} (or a taskpoint.SaveInterval)") from None


class TimedSaves:
    """The callback's saves by time: the interval (made at training start from
    ``save_every_s``), the decision at each step end, and the measurement of each save.

    Args:
        spec: ``save_every_s`` (checked by :func:`check_save_every`); ``None``: no timed
            saves, and saves are not measured.
    """

    def __init__(self, spec: SaveEvery | None) -> None:
        self.spec = spec
        self.interval: SaveInterval | None = spec if isinstance(spec, SaveInterval) else None
        self._began: float | None = None  # when training began to wait for the save asked

    def start(self, checkpoint: CheckpointLike) -> None:
        """Make the interval (once) with ``SaveInterval.for_checkpoint``: a
        :class:`taskpoint.Checkpoint`'s attempt history and uploads' commits."""
        if self.interval is None and self.spec is not None and not isinstance(
            self.spec, SaveInterval
        ):
            self.interval = SaveInterval.for_checkpoint(checkpoint, self.spec)

    def at_step_end(self, control: TrainerControl) -> None:
        """Count the step; ask for a save when one is due by world process zero's clock
        (every rank calls this: one broadcast)."""
        interval = self.interval
        if interval is None:
            return
        interval.step_done()
        if interval.due(agree=lambda due: bool(broadcast_from_zero(due))):
            control.should_save = True
        self.asked(control)

    def asked(self, control: TrainerControl) -> None:
        """The Trainer may save next (after logging and evaluating): the wait starts now."""
        self._began = time.monotonic() if control.should_save else None

    def before_save(self, control: TrainerControl) -> None:
        """The Trainer logged or evaluated before the save it was asked for: that is not
        the save's cost."""
        if self._began is not None and control.should_save:
            self._began = time.monotonic()

    def saved(self, began: float, *, background: bool) -> None:
        """The Trainer's save is written and its upload started (``on_save``, which began
        at ``began``): restart the interval with what training waited."""
        interval = self.interval
        if interval is None:
            return
        since = self._began if self._began is not None else began
        self._began = None
        interval.saved(blocked_s=max(0.0, time.monotonic() - since), background=background)

"""Saves by training time (``save_every_s``): seconds, ``"auto"`` or a
:class:`taskpoint.SaveInterval`. At each step end world process zero's clock decides (one
broadcast) and ``control.should_save`` makes the Trainer write its own ``checkpoint-N``.
Every save the Trainer makes is measured from the step's end (or the log and evaluation
before it) to the end of ``on_save`` and restarts the interval; a background upload is
measured by the interval itself, until its commit.
"""

from __future__ import annotations

import time
from typing import Literal

from taskpoint import SaveInterval
from taskpoint.integration import TimedSaves as _TimedSaves
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


class TimedSaves(_TimedSaves):
    """Core's timed saves (``spec``: ``save_every_s``; ``None``: no timed saves, none
    measured), and when the Trainer was asked to save: its wait counts from there."""

    def __init__(self, spec: SaveEvery | None) -> None:
        super().__init__(spec)
        self._began: float | None = None  # when training began to wait for the save asked

    def at_step_end(self, control: TrainerControl) -> None:
        """Count the step; ask for a save when one is due by world process zero's clock
        (every rank calls this: one broadcast, with an interval)."""
        if self.due(lambda due: bool(broadcast_from_zero(due))):
            control.should_save = True

    def asked(self, control: TrainerControl) -> None:
        """The Trainer may save next (after logging and evaluating): the wait starts now."""
        self._began = time.monotonic() if control.should_save else None

    def before_save(self, control: TrainerControl) -> None:
        """The Trainer logged or evaluated before the save it was asked for: that is not
        the save's cost."""
        if self._began is not None and control.should_save:
            self._began = time.monotonic()

    def saved_since(self, began: float, *, background: bool) -> None:
        """The Trainer's save is written and its upload started (``on_save``, which began
        at ``began``): restart the interval with what training waited."""
        since = self._began if self._began is not None else began
        self._began = None
        self.saved(blocked_s=time.monotonic() - since, background=background)

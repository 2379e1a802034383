"""The training step an attempt has reached, as the training code reports it.

A checkpoint knows bytes, not steps. The adapters (and any training loop) report the step
they have finished with :func:`report_step`; taskpoint then writes it where it tells the
cost of a failure:

- each save's manifest carries the step reported when ``save`` was called (``step``);
- an attempt's end record carries the last step it reported (the step it failed at);
- the next attempt's resume record carries the step of the checkpoint it loaded, so
  ``taskpoint show`` and the resume log line state the steps lost in between.

The step is per process: the last value reported wins. A task's runner forgets it when
an attempt starts.
"""

from __future__ import annotations

__all__ = ["current_step", "report_step", "reset"]

_step: int | None = None


def report_step(step: int) -> None:
    """Record that training has finished ``step`` (a count of optimizer steps, from 0).

    Raises:
        TypeError: ``step`` is not an integer.
        ValueError: ``step`` is negative.
    """
    global _step
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int (a count of training steps); got {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0; got {step!r}")
    _step = step


def current_step() -> int | None:
    """The step last given to :func:`report_step`, or ``None`` if none was."""
    return _step


def reset() -> None:
    """Forget the step (an attempt starting afresh in this process)."""
    global _step
    _step = None

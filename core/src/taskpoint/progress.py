"""The training step an attempt has reached, as the training code reports it.

A checkpoint knows bytes, not steps. The adapters (and any training loop) report the step
they have finished with :func:`report_step`; taskpoint then writes it where it tells the
cost of a failure:

- each save's manifest carries the step reported when ``save`` was called (``step``);
- an attempt's end record carries the last step it reported (the step it failed at);
- the next attempt's resume record carries the step of the checkpoint it loaded, so
  ``taskpoint show`` and the resume log line state the steps lost in between.

The step is per process: the last value reported wins. A task's runner forgets it when
an attempt starts. An adapter whose save reaches the checkpoint later, from a thread of
its own (serialising first), runs that call under :func:`pinned` so its manifest names the
step of the save, not a step reported meanwhile.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TypeVar

from taskpoint import preemption

__all__ = ["as_of_now", "current_step", "pinned", "report_step", "reset"]

_T = TypeVar("_T")

_step: int | None = None
_UNPINNED = -1
_pinned: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "taskpoint_pinned_step", default=_UNPINNED
)


def report_step(step: int) -> None:
    """Record that training has finished ``step`` (a count of optimizer steps, from 0).

    Raises:
        TypeError: ``step`` is not an integer.
        ValueError: ``step`` is negative.
    """
    global _step
    _step = _checked(step)


def _checked(step: object) -> int:
    """``step`` if it is a count of steps.

    Raises:
        TypeError: ``step`` is not an integer.
        ValueError: ``step`` is negative.
    """
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int (a count of training steps); got {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0; got {step!r}")
    return step


def current_step() -> int | None:
    """The step last given to :func:`report_step`, or ``None`` if none was; inside
    :func:`pinned`, the step pinned there."""
    step = _pinned.get()
    return _step if step == _UNPINNED else step


@contextlib.contextmanager
def pinned(step: int | None) -> Iterator[None]:
    """Within, in this context only (this thread, or this task), :func:`current_step` is
    ``step``: for a save handed to a checkpoint after the training loop moved on, made for
    a step reached earlier (taken with :func:`current_step` when the save was called).

    Raises:
        TypeError: ``step`` is neither an integer nor ``None``.
        ValueError: ``step`` is negative.
    """
    if step is not None:
        _checked(step)
    token = _pinned.set(step)
    try:
        yield
    finally:
        _pinned.reset(token)


def reset() -> None:
    """Forget the step (an attempt starting afresh in this process)."""
    global _step
    _step = None


def as_of_now(job: Callable[[], _T]) -> Callable[[], _T]:
    """``job``, to be run later (on an upload thread, after training moved on) as if now.

    Takes :func:`current_step` and :func:`taskpoint.preemption.requested` when called; the
    returned callable runs ``job`` under :func:`pinned` and
    :func:`taskpoint.preemption.pinned` with those answers and returns what
    ``job`` returned (or raises what it raised). A save made by ``job`` then records
    the step, and whether a preemption signal had come, as of the call: what an adapter
    that serialises first and hands the save to a checkpoint from its own thread needs.
    """
    step, signalled = current_step(), preemption.requested()

    def run() -> _T:
        with pinned(step), preemption.pinned(signalled):
            return job()

    return run

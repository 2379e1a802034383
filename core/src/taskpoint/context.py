"""``ctx()``: what the running task knows about itself."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from taskpoint.checkpoint import Checkpoint

__all__ = ["TaskContext", "ctx"]


@dataclass(frozen=True)
class TaskContext:
    """The context of one attempt of a running task.

    Attributes:
        task: the task's name, ``"<environment>.<function>"``.
        run_id: the run this action belongs to.
        action: the action's id, ``"<task>/<run_id>"``: all attempts share it.
        attempt: this attempt's number, from 0.
        retries: how many retries the task allows after attempt 0.
        checkpoint: the action's checkpoint, or ``None`` where checkpoints are disabled.
    """

    task: str
    run_id: str
    action: str
    attempt: int
    retries: int
    checkpoint: Checkpoint | None


_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar(
    "taskpoint_context", default=None
)


def ctx() -> TaskContext | None:
    """The running task's context, or ``None`` outside any task."""
    return _current.get()

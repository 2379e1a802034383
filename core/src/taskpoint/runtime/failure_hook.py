"""How a plain loop's adapter hears that an exception ends the attempt, to save the state of
its last step boundary there (``save_on_exception``): :class:`FailureHook`.

A loop's save call is the adapter's only moment in the loop, and the attempt's context can
change between calls (a retry of an inline task is a new context in the same process), so
the adapter calls :meth:`FailureHook.follow` at each call: it subscribes to the context of
the moment (:meth:`taskpoint.TaskContext.on_failure`) once, and outside a task and the
environment contract, where nothing says when an attempt fails, warns once that no save at
a failure is made there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from taskpoint.errors import warn
from taskpoint.runtime.context import TaskContext, ctx

__all__ = ["FailureHook"]

log = logging.getLogger(__name__)


class FailureHook:
    """Calls ``callback(exc)`` when an exception ends the attempt in which :meth:`follow`
    was last called (see the module docs; :meth:`taskpoint.TaskContext.on_failure` says
    which exceptions count).

    Args:
        callback: a bound method of the adapter's (the context holds it until the attempt
            ends).
        option: the option's name and value as the user wrote it, for the warning
            (``"save_on_exception=True"``).
    """

    def __init__(self, callback: Callable[[BaseException], object], option: str) -> None:
        self._callback = callback
        self._option = option
        self._context: TaskContext | None = None
        self._warned = False

    def follow(self, *, stacklevel: int = 2) -> bool:
        """A step boundary: make sure the current attempt's failure calls back. Cheap
        after the first call in an attempt.

        Args:
            stacklevel: whose line the warning names, counted from the caller of this
                method as :func:`warnings.warn` counts (2: that caller's caller).

        Returns:
            Whether an attempt's failure will call back (``False`` outside a task and the
            environment contract, after a warning the first time).
        """
        context = ctx()
        if context is None:
            if not self._warned:
                self._warned = True
                warn(
                    log,
                    f"{self._option} saves only inside a taskpoint task or a process of the "
                    "environment contract (TASKPOINT_ACTION set): nothing else says when an "
                    "attempt fails, so no save is made at a failure here",
                    stacklevel=stacklevel + 1,
                )
            return False
        if context is not self._context:
            self._context = context
            context.on_failure(self._callback)
        return True

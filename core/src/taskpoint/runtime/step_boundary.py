"""Step boundaries of a plain training loop: where a preemption signal becomes a save.

A framework calls its adapter back at every step (Lightning's callbacks, the Trainer's);
a plain loop runs only what its author wrote, and the adapter's save call between two
steps is the one place where taskpoint runs while the training state is consistent. A
:class:`StepBoundary` makes that call a step boundary (taskpoint_pytorch's
``TaskpointState.save_sync`` and taskpoint_sklearn's ``TaskpointSklearnCheckpoint.save_sync``
use one)::

    boundary = StepBoundary(save_on_preemption)      # the adapter's argument
    boundary.begin()                                  # at train start (a restore), every rank
    ...
    if boundary.reached(step):                        # at each save call, every rank
        saved = boundary.fits(last_save_s, size=nbytes, checkpoint=ckpt)  # time enough?
        if saved:
            save()                                    # marked as the preemption save
        boundary.stop(step, saved=saved)              # raises taskpoint.Preempted

Whether a SIGTERM becomes a save is :func:`taskpoint.preemption.save_on_preemption`'s rule
(the argument, then ``TASKPOINT_SAVE_ON_PREEMPTION``, then: inside a taskpoint task or a
process of the environment contract, :func:`taskpoint.runtime.context.supervised`). When
it does, :meth:`~StepBoundary.begin` puts taskpoint's SIGTERM handler on top and enters
:func:`taskpoint.preemption.deferred`, so the signal only sets the notice, and the next
:meth:`~StepBoundary.reached` answers ``True`` on every rank (a flag or'ed across the ranks
by :class:`taskpoint.distributed.torch_coordination.AnyRank`: the signal may reach one rank
only). The deferral ends with :meth:`~StepBoundary.stop` or with the attempt
(:meth:`taskpoint.TaskContext.on_end`); outside a task, with the process. When it is off,
nothing changes but the step being reported. The stop itself is
:class:`taskpoint.runtime.preemption_stop.PreemptionStop`, the sequence every adapter shares.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import NoReturn

from taskpoint import preemption, progress
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.runtime import _life
from taskpoint.runtime.context import TaskContext, _current, supervised
from taskpoint.runtime.preemption_stop import (
    MARGIN_S,
    Alone,
    Decision,
    PreemptionStop,
    why_not_saved,
)

__all__ = [
    "ASSUMED_RATE",
    "SAVE_OVERHEAD_S",
    "SETTLE_S",
    "StepBoundary",
    "estimate_save_s",
    "settle_time",
]

log = logging.getLogger(__name__)

SETTLE_S = 60.0
"""How long the end of an attempt waits for an upload in flight when no preemption
signal set a deadline (as long as interpreter exit waits,
``taskpoint.checkpoint.mirror.EXIT_WAIT_S``)."""


ASSUMED_RATE = 25 * 2**20
"""The upload rate (bytes per second) a preemption save's estimate assumes when the process
knows none (it neither saved nor restored anything yet): a modest link to an object store,
so a save that fits by it fits on most. A process that restored knows better: see
:func:`estimate_save_s`."""
SAVE_OVERHEAD_S = 1.0
"""Seconds an estimate adds to a save's bytes: the snapshot, the manifest and the store's
round trips (listing, the lease, the commit)."""


def estimate_save_s(checkpoint: object, size: int | None) -> float | None:
    """How long a save of ``size`` bytes to ``checkpoint`` should take, when no save of this
    process was timed yet (a fresh process, preempted before its first save).

    The estimate is ``size`` over the link's upload rate plus :data:`SAVE_OVERHEAD_S`. The
    rate is the best this process knows of a :class:`taskpoint.Checkpoint`'s link: its
    newest commit's (bytes uploaded over upload seconds); else what the checkpoint it
    restored cost when an earlier process saved it (its manifest's ``stats``); else that
    restore's own rate; else :data:`ASSUMED_RATE`.

    Returns:
        Seconds; ``None`` when ``size`` is unknown (``None``).
    """
    if size is None:
        return None
    rate: float | None = None
    if isinstance(checkpoint, Checkpoint):
        rate = checkpoint._saves.upload_rate()
    known = rate is not None
    seconds = SAVE_OVERHEAD_S + max(0, size) / (rate if rate else ASSUMED_RATE)
    log.debug(
        "a save of %d bytes should take %.1f s (%s rate %.1f MB/s)", size, seconds,
        "measured" if known else "assumed", (rate or ASSUMED_RATE) / 1e6,
    )
    return seconds


def settle_time() -> float:
    """Seconds the end of an attempt may now wait for an upload in flight: the grace
    period left less :data:`MARGIN_S` once a preemption signal came (0 once that has
    passed), else :data:`SETTLE_S`."""
    notice = preemption.notice()
    return SETTLE_S if notice is None else max(0.0, notice.remaining() - MARGIN_S)


def _alone(timeout: float) -> Alone:
    """The agreement of a process that decides alone (``timeout`` unused)."""
    return Alone()


class StepBoundary:
    """A plain training loop's step boundaries, as its adapter's save call sees them.

    Args:
        save_on_preemption: whether a SIGTERM becomes a save at the next boundary;
            ``None``: ``TASKPOINT_SAVE_ON_PREEMPTION``, else whether the loop runs inside a
            taskpoint task (decided at :meth:`begin`).
        ranks: agree across the ranks of a ``torch.distributed`` process group (of more
            than one rank) whether any received the signal; :meth:`begin` and
            :meth:`reached` are then collectives.
        timeout: seconds the agreement waits for the other ranks.
        settle: waits at most the given seconds for the adapter's upload in flight (and
            raises its error); run when the attempt ends, so a loop that raised leaves no
            save half uploaded.

    Raises:
        ValueError: ``timeout`` is not a positive number.
    """

    def __init__(
        self,
        save_on_preemption: bool | None = None,
        *,
        ranks: bool = True,
        timeout: float = 600.0,
        settle: Callable[[float], object] | None = None,
    ) -> None:
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        self._choice = save_on_preemption
        self._settle = settle
        self._enabled = False
        self._scope: contextlib.ExitStack | None = None
        self._context: TaskContext | None = None
        self._stop = PreemptionStop(timeout=timeout, agreement=None if ranks else _alone)

    def __repr__(self) -> str:
        return f"StepBoundary(enabled={self._enabled}, active={self._scope is not None})"

    @property
    def enabled(self) -> bool:
        """Whether a SIGTERM becomes a save (decided by the last :meth:`begin`)."""
        return self._enabled

    def begin(self) -> None:
        """Training starts (or goes on) in this attempt: decide whether a SIGTERM becomes a
        save and, if so, defer it to the next boundary. Idempotent within an attempt.

        Under ``torch.distributed`` with ``ranks``, a collective (the agreement's group is
        made here) the first time in each attempt: every rank calls it at the same point.

        Raises:
            ValueError: ``TASKPOINT_SAVE_ON_PREEMPTION`` or ``TASKPOINT_GRACE_PERIOD`` is
                set to something unusable.
        """
        context = _current.get()
        if self._scope is not None and context is self._context:
            return
        self.end(settle=False)
        scope = contextlib.ExitStack()
        self._scope, self._context = scope, context
        if context is not None:
            context.on_end(self.end)
        self._enabled = preemption.save_on_preemption(
            self._choice, in_task=context is not None or supervised()
        )
        if not self._enabled:
            return
        self._stop.begin()  # (outside the main thread, with a WARNING)
        scope.callback(self._stop.close)

    def reached(self, step: int | None) -> bool:
        """The loop finished ``step`` (a count, from 0; ``None``: not known here): report
        it, and say whether to save now and stop, on every rank alike.

        Returns:
            ``True`` once a preemption signal reached this rank or another (the rank that
            did not receive it takes the notice too: :func:`taskpoint.preemption.relay`).

        Raises:
            TypeError, ValueError: ``step`` is not a count.
            CheckpointCoordinationError: another rank did not arrive within the timeout.
        """
        if step is not None:
            progress.report_step(step)
        self.begin()
        if not self._enabled:
            return False
        flag = self._stop.requested()
        if flag:
            preemption.relay()
            self._record_stopping(step)
        return flag

    def _record_stopping(self, step: int | None) -> None:
        """Record the attempt as preempted now, before its preemption save, so that a kill
        at the grace period's end finds its end recorded (the stop, or the runner, writes
        the final record after the save). Best effort."""
        message = f"stopping at step {step} to save" if step is not None else "stopping to save"
        if self._context is None:
            life = _life.current()
            if life is not None:
                life.preempted(message, step=step)
        elif self._context.checkpoint is not None and _life.leads():
            self._context.checkpoint.mark_ended("preempted", f"Preempted: {message}", step=step)

    def decide(
        self,
        step: int | None,
        *,
        wait: Callable[[float], bool],
        estimate: Callable[[], float | None],
    ) -> Decision:
        """Once :meth:`reached` said so (every rank): :meth:`PreemptionStop.decide`, the
        sequence every adapter shares (agree on the deadline, ``wait`` for the upload in
        flight, agree whether the save fits)."""
        return self._stop.decide(step, wait=wait, estimate=estimate)

    def budget(self) -> float:
        """Seconds a preemption save may take: the time left before the deadline
        :meth:`decide` agreed on (else this process's), minus :data:`MARGIN_S` (infinite
        without a notice)."""
        decision = self._stop.decision
        if decision is not None and self._scope is not None:
            return decision.deadline - time.monotonic() - MARGIN_S
        notice = preemption.notice()
        return math.inf if notice is None else notice.remaining() - MARGIN_S

    def fits(
        self, estimate_s: float | None, *, size: int | None = None, checkpoint: object = None
    ) -> bool:
        """Whether a save that takes ``estimate_s`` seconds fits in :meth:`budget`.

        Args:
            estimate_s: how long the last save took; ``None``: none was made yet.
            size: the bytes the save will write, when known: with no ``estimate_s``, the
                save is estimated from them and ``checkpoint``'s link
                (:func:`estimate_save_s`) rather than tried blind.
            checkpoint: where the save goes.

        Returns:
            Whether it fits; with neither an estimate nor a size, whether any time is left.
        """
        if estimate_s is None:
            estimate_s = estimate_save_s(checkpoint, size)
        return not why_not_saved(True, estimate_s, self.budget() + MARGIN_S)

    def stop(
        self,
        step: int | None,
        *,
        saved: bool,
        reason: str = "",
        checkpoint: object = None,
        leader: bool = True,
        cause: BaseException | None = None,
    ) -> NoReturn:
        """End the training after the preemption save committed (``saved``) or was given up
        (``reason`` says why): log it, leave the deferral and raise.

        Outside a task, where no runner records the attempt, the ``leader`` (rank 0)
        records its end as preempted in ``checkpoint`` when it is a
        :class:`taskpoint.Checkpoint`.

        Raises:
            Preempted: always; from ``cause`` when given.
        """
        notice = preemption.notice()
        signal = notice.signal if notice is not None else "a preemption signal"
        where = f"{signal} at step {step}" if step is not None else signal
        if saved:
            after = f" {time.time() - notice.received:.1f} s after the signal" if notice else ""
            message = (
                f"{where}: the preemption save committed{after}; the next attempt resumes "
                "at this step"
            )
        else:
            message = (
                f"{where}: no preemption save ({reason or 'it failed'}); the next attempt "
                "resumes from the newest earlier checkpoint"
            )
        try:
            self._stop.end(
                message, step=step, leader=leader,
                checkpoint=checkpoint if self._context is None else None, cause=cause,
            )
        finally:
            self.end(settle=False)

    def end(self, settle: bool = True) -> None:
        """The training ended: wait (bounded) for the adapter's upload in flight with
        ``settle``, leave the deferral and close the agreement's group. Idempotent.

        Raises:
            Exception: the upload's error (``settle``).
        """
        scope, self._scope = self._scope, None
        if scope is None:
            return
        with scope:
            if settle and self._settle is not None:
                self._settle(settle_time())

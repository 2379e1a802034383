"""TaskpointState's step boundaries: a SIGTERM becomes a save at the next ``save_sync`` call.

A plain loop already calls ``state.save_sync(checkpoint, epoch=..., step=...)`` between
steps, with the state consistent; that call is the step boundary
(:class:`taskpoint.runtime.step_boundary.StepBoundary`). At each one, on every rank, the finished
step is reported and, when SIGTERM becomes a save (inside a taskpoint task by default),
the ranks agree whether any received it. If one did, the call saves at once, whatever
``every`` says, waits for the commit within the grace period left, and raises
:class:`taskpoint.Preempted`; the next attempt resumes at that step. A loop that saves
every N steps calls ``save_sync(..., every=N)`` at every step, so the stop lands at the
next step, not the next save.

``every_s`` saves by training time (:class:`taskpoint.runtime.interval.SaveSchedule`):
each call times the step, and a save is due once ``every_s`` seconds passed since the last
save (or the interval ``"auto"`` chose); under ``torch.distributed`` rank 0's clock decides
for every rank with one collective, so all save at the same step.

Deadlines: core's :class:`taskpoint.runtime.preemption_stop.PreemptionStop`, the sequence
every adapter shares. A background save waiting behind the upload in flight is replaced by
the preemption save (it goes first); the upload in flight is finished first (within the
time left); a save that took longer last time than the time left (or, with none timed yet
in this process, whose estimate from the state's bytes and the link does:
:func:`taskpoint.runtime.step_boundary.estimate_save_s`) is skipped, loudly, and the newest
earlier checkpoint stays intact (the attempt's record says the preemption save was missed).
A background save waits for its commit at most until the grace period's end, less
:data:`taskpoint.runtime.preemption_stop.MARGIN_S`; a blocking save is the training thread
itself and runs to its end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Literal

from taskpoint import report_step
from taskpoint.integration import (
    SaveSchedule,
    StepBoundary,
    UploadThread,
    as_of_now,
    broadcast_from_zero,
    estimate_save_s,
    is_distributed,
    note_coalesced,
    rank_and_size,
)

__all__ = ["Preemption", "Turn"]

log = logging.getLogger(__name__)


def step_of(epoch: object, step: object) -> int | None:
    """The loop's counter: ``step`` when the loop counts steps, else ``epoch``; ``None``
    when it is not a count (the save then says so, on every rank)."""
    counter = step or epoch
    if isinstance(counter, bool) or not isinstance(counter, int) or counter < 0:
        return None
    return counter


class _TimedUploads(UploadThread):
    """TaskpointState's upload thread: each job runs with the step of the save that started
    it, and whether a preemption signal had come by then, pinned (its manifest says so, not
    what holds when the thread hands it over) and, once committed, records how long the save
    took from its call."""

    def __init__(self, owner: Preemption) -> None:
        super().__init__("taskpoint-state-upload")
        self._owner = owner

    def start(
        self,
        job: Callable[[], object],
        *,
        on_drop: Callable[[], object] | None = None,
        ticket: int | None = None,
    ) -> bool:
        owner = self._owner
        called = owner.turn_started or time.monotonic()
        queued = time.monotonic() - called  # the copy before it was queued
        as_called = as_of_now(job)  # the step and the preemption answer, pinned as of now
        owner.job_started = True

        def run() -> None:
            began = time.monotonic()  # after any upload it waited behind
            as_called()
            owner.last_save_s = queued + time.monotonic() - began

        return super().start(run, on_drop=on_drop, ticket=ticket)


class Preemption:
    """The preemption side of one :class:`~taskpoint_pytorch.TaskpointState`.

    Args:
        save_on_preemption: the state's argument (see
            :func:`taskpoint.preemption.save_on_preemption`).
    """

    def __init__(
        self, save_on_preemption: bool | None, size: Callable[[], int | None] | None = None
    ) -> None:
        self.size = size  # the state's bytes, for a fresh process's first estimate
        self.uploads: UploadThread = _TimedUploads(self)
        self.boundary = StepBoundary(save_on_preemption, settle=self._settle)
        self.schedule = SaveSchedule()  # which boundaries save: every N steps and/or seconds
        self.last_save_s: float | None = None  # how long the last save took, call to commit
        self.turn_started: float | None = None
        self.job_started = False

    def begin(self, epoch: int, step: int) -> None:
        """A restore finished (every rank): report the step it resumes at and start
        deferring SIGTERM to the next boundary (a collective the first time per attempt)."""
        counter = step_of(epoch, step)
        if counter is not None:
            report_step(counter)
        self.schedule.start()  # ``every_s`` counts from here
        self.boundary.begin()

    def reached(
        self,
        checkpoint: object,
        epoch: int,
        step: int,
        every: int | None,
        every_s: float | Literal["auto"] | None = None,
    ) -> Turn:
        """A ``save_sync`` call (every rank): report the step, agree whether a rank was
        preempted, and say what the call does: save when ``every`` (steps) or ``every_s``
        (seconds of training since the last save, or ``"auto"``; rank 0's clock decides
        for every rank, one collective) says so, or when neither is given.

        Raises:
            ValueError: ``every`` is not a positive int, ``every_s`` not a positive number
                of seconds or ``"auto"``, or a counter is negative.
            TypeError: a counter is not an int.
            taskpoint.Preempted: a rank was preempted and the save cannot fit in the time
                left (or an upload in flight did not finish within it): none is made.
        """
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be a positive int (steps between saves); got {every!r}")
        counter = step_of(epoch, step)
        if not self.boundary.reached(counter):
            agree = broadcast_from_zero if is_distributed() else None
            return Turn(self, save=self.schedule.due(checkpoint, counter, every, every_s, agree))
        rank = rank_and_size()[0]
        decision = self.boundary.decide(
            counter, wait=lambda timeout: self._in_flight(checkpoint, timeout),
            estimate=lambda: self._estimate(checkpoint) if rank == 0 else None,
        )
        if not decision.saving:
            self.boundary.stop(
                counter, saved=False, reason=decision.reason, checkpoint=checkpoint,
                leader=rank == 0,
            )
        return Turn(self, save=True, stop=(counter, checkpoint))

    def _in_flight(self, checkpoint: object, timeout: float) -> bool:
        """The preemption save replaces a background save waiting behind the upload in
        flight (it goes first); finish that upload within ``timeout`` seconds: whether it
        is done (a failed one is logged: the preemption save may still land)."""
        if self.uploads.drop_pending():
            note_coalesced(checkpoint)
        try:
            return self.uploads.wait(timeout)
        except Exception as exc:  # that save is lost; the preemption save may still land
            log.warning("the background save before the preemption failed: %s: %s",
                        type(exc).__name__, exc)
            return True

    def _estimate(self, checkpoint: object) -> float | None:
        """Seconds a save should take: the last one's, else estimated from the state's
        bytes and the link (global rank 0 writes, so its estimate is the job's)."""
        if self.last_save_s is not None:
            return self.last_save_s
        return estimate_save_s(checkpoint, self.size() if self.size else None)

    def _settle(self, timeout: float) -> None:
        """The attempt ended: wait for the upload in flight (its error is raised)."""
        if not self.uploads.wait(timeout):
            log.warning("a background save still uploads after %.1f s; the attempt ends "
                        "without it", timeout)


class Turn:
    """What one ``save_sync`` call does: :attr:`save` says whether it saves; the save runs
    inside ``with turn:``, which times it, and for a preemption save waits for its commit
    (rank 0, within the time left), agrees on the outcome and raises
    :class:`taskpoint.Preempted`."""

    def __init__(
        self, owner: Preemption, *, save: bool, stop: tuple[int | None, object] | None = None
    ) -> None:
        self._owner = owner
        self.save = save
        self._stop = stop

    def __enter__(self) -> Turn:
        self._owner.turn_started = time.monotonic()
        self._owner.job_started = False
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        owner = self._owner
        started, owner.turn_started = owner.turn_started, None
        if self._stop is None:
            if exc is None and started is not None:
                blocked = time.monotonic() - started
                if not owner.job_started:
                    owner.last_save_s = blocked
                owner.schedule.saved(blocked_s=blocked, background=owner.job_started)
            return
        step, checkpoint = self._stop
        rank = rank_and_size()[0]
        committed, cause = exc is None, exc
        if committed and rank == 0:
            try:
                committed = owner.uploads.wait(max(0.0, owner.boundary.budget()))
            except Exception as error:
                committed, cause = False, error
        outcome = broadcast_from_zero(
            (committed, None if cause is None else f"{type(cause).__name__}: {cause}")
        )
        committed, failure = outcome
        reason = failure or "the save did not commit before the grace period's end"
        owner.boundary.stop(
            step, saved=committed, reason=reason, checkpoint=checkpoint, leader=rank == 0,
            cause=cause,
        )

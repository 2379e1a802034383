"""A plain loop's save call, whole: which calls save, and how a SIGTERM becomes a save.

A plain loop (taskpoint_pytorch's ``TaskpointState.save_sync``, taskpoint_sklearn's
``TaskpointSklearnCheckpoint.save_sync``) calls its adapter's save between steps, with the
state consistent; that call is the step boundary (:class:`StepBoundary`). A
:class:`BoundarySaves` is what such an adapter holds to run it::

    saves = BoundarySaves(save_on_preemption)         # the adapter's argument
    saves.begin(counter)                              # after the restore, every rank
    ...
    turn = saves.reached(checkpoint, counter, every, every_s)   # each save call
    if turn.save:
        with turn:                                    # times it; a preemption save stops
            save()                                    # raises taskpoint.Preempted at exit

At each call, on every rank, the finished step is reported and, when SIGTERM becomes a save
(inside a taskpoint task by default), the ranks agree whether any received it. If one did,
the call saves at once, whatever ``every`` says, waits for the commit within the grace
period left, and raises :class:`taskpoint.Preempted`; the next attempt resumes at that step.
Otherwise :class:`SaveSchedule` says whether the call saves: every ``every`` steps, and/or
once ``every_s`` seconds of training passed (under ``torch.distributed`` rank 0's clock
decides for every rank, one collective).

Deadlines are :class:`taskpoint.runtime.preemption_stop.PreemptionStop`'s. A background save
(:attr:`BoundarySaves.uploads`) waiting behind the upload in flight is replaced by the
preemption save (it goes first); the upload in flight is finished first (within the time
left), unless it was handed to a :class:`taskpoint.Checkpoint`, where the preemption save
stops it (see ``when_busy``); a save that took longer last time than the time left (or,
with none timed yet in this process, whose estimate from the state's bytes and the link does:
:func:`estimate_save_s`) is skipped, loudly, and the newest earlier checkpoint stays intact.
A background preemption save waits for its commit at most until the grace period's end,
less :data:`~taskpoint.runtime.preemption_stop.MARGIN_S`; a blocking save is the training
thread itself and runs to its end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Literal

from taskpoint import progress
from taskpoint.checkpoint._upload_thread import UploadThread
from taskpoint.checkpoint.mirror import make_way, note_coalesced
from taskpoint.distributed import broadcast_from_zero, is_distributed, rank_and_size
from taskpoint.runtime.interval import IntervalChoice, SaveSchedule
from taskpoint.runtime.step_boundary import StepBoundary, estimate_save_s

__all__ = ["BoundarySaves", "Turn", "loop_counter"]

log = logging.getLogger(__name__)


def loop_counter(counter: object) -> int | None:
    """``counter`` when it is a count (an int from 0, not a bool); else ``None`` (the save
    then says what is wrong, on every rank)."""
    if isinstance(counter, bool) or not isinstance(counter, int) or counter < 0:
        return None
    return counter


class _TimedUploads(UploadThread):
    """Background uploads whose jobs run with the step of the save that started them, and
    whether a preemption signal had come by then, pinned (the manifest says so, not what
    holds when the thread hands it over); once committed, the save's time from its call is
    recorded."""

    def __init__(self, owner: BoundarySaves, name: str) -> None:
        super().__init__(name)
        self._owner = owner

    def start(
        self,
        job: Callable[[], object],
        *,
        on_drop: Callable[[], object] | None = None,
        ticket: int | None = None,
        stop: Callable[[], object] | None = None,
    ) -> bool:
        owner = self._owner
        called = owner.turn_started or time.monotonic()
        queued = time.monotonic() - called  # the copy before it was queued
        as_then = progress.as_of_now(job)
        owner.job_started = True

        def run() -> None:
            began = time.monotonic()  # after any upload it waited behind
            as_then()
            owner.last_save_s = queued + time.monotonic() - began

        return super().start(run, on_drop=on_drop, ticket=ticket, stop=stop)


class BoundarySaves:
    """The save calls of one plain-loop adapter object (see the module's documentation).

    Args:
        save_on_preemption: the adapter's argument (see
            :func:`taskpoint.preemption.save_on_preemption`).
        ranks: agree across a ``torch.distributed`` job's ranks (rank 0 writes); ``False``:
            this process decides alone.
        unit: what ``every`` counts, for its error message.
        size: the state's bytes, for a fresh process's first estimate of a save.
        thread: the name of the thread running background saves (:attr:`uploads`; an
            adapter without them never starts it).
    """

    def __init__(
        self,
        save_on_preemption: bool | None,
        *,
        ranks: bool = True,
        unit: str = "steps",
        size: Callable[[], int | None] | None = None,
        thread: str = "taskpoint-upload",
    ) -> None:
        self.ranks = ranks
        self.unit = unit
        self.size = size
        self.uploads: UploadThread = _TimedUploads(self, thread)
        self.boundary = StepBoundary(save_on_preemption, ranks=ranks, settle=self._settle)
        self.schedule = SaveSchedule()  # which boundaries save: every N steps and/or seconds
        self.last_save_s: float | None = None  # how long the last save took, call to commit
        self.turn_started: float | None = None
        self.job_started = False

    @property
    def interval_choice(self) -> IntervalChoice | None:
        """The interval ``every_s`` asked for, and what it was chosen from; ``None``
        before a call with ``every_s``."""
        interval = self.schedule.interval
        return None if interval is None else interval.choice

    def leads(self) -> bool:
        """Whether this process leads (writes, logs, records): global rank 0, or alone."""
        return not self.ranks or rank_and_size()[0] == 0

    def begin(self, counter: object) -> None:
        """A restore finished (every rank): report the step it resumes at and start
        deferring SIGTERM to the next boundary (a collective the first time per attempt)."""
        step = loop_counter(counter)
        if step is not None:
            progress.report_step(step)
        self.schedule.start()  # ``every_s`` counts from here
        self.boundary.begin()

    def reached(
        self,
        checkpoint: object,
        counter: object,
        every: int | None,
        every_s: float | Literal["auto"] | None = None,
    ) -> Turn:
        """A save call (every rank): report the step, agree whether a rank was preempted,
        and say what the call does: save when ``every`` (steps) or ``every_s`` (seconds of
        training since the last save, or ``"auto"``) says so, or when neither is given.

        Raises:
            ValueError: ``every`` is not a positive int, ``every_s`` not a positive number
                of seconds or ``"auto"``.
            taskpoint.Preempted: a rank was preempted and the save cannot fit in the time
                left (or an upload in flight did not finish within it): none is made.
        """
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"every must be a positive int ({self.unit} between saves); got {every!r}"
            )
        step = loop_counter(counter)
        if not self.boundary.reached(step):
            agree = broadcast_from_zero if self.ranks and is_distributed() else None
            return Turn(self, save=self.schedule.due(checkpoint, step, every, every_s, agree))
        leader = self.leads()
        decision = self.boundary.decide(
            step, wait=lambda timeout: self._in_flight(checkpoint, timeout),
            estimate=lambda: self._estimate(checkpoint) if leader else None,
        )
        if not decision.saving:
            self.boundary.stop(
                step, saved=False, reason=decision.reason, checkpoint=checkpoint, leader=leader
            )
        if leader:  # the preemption save goes first: older uploads there stop
            make_way(checkpoint)
        return Turn(self, save=True, stop=(step, checkpoint))

    def _in_flight(self, checkpoint: object, timeout: float) -> bool:
        """The preemption save replaces a background save waiting behind the upload in
        flight (it goes first); finish that upload within ``timeout`` seconds, or only
        until it was handed to a :class:`taskpoint.Checkpoint` (:meth:`UploadThread.hand_over`),
        whose newer blocking save stops it: whether so (a failed one is logged: the
        preemption save may still land)."""
        if self.uploads.drop_pending():
            note_coalesced(checkpoint)
        try:
            done = self.uploads.wait_handed(timeout)
            self.uploads.raise_error()
            return done
        except Exception as exc:  # that save is lost; the preemption save may still land
            log.warning("the background save before the preemption failed: %s: %s",
                        type(exc).__name__, exc)
            return True

    def _estimate(self, checkpoint: object) -> float | None:
        """Seconds a save should take: the last one's, else estimated from the state's
        bytes and the link (the leader writes, so its estimate is the job's)."""
        if self.last_save_s is not None:
            return self.last_save_s
        return estimate_save_s(checkpoint, self.size() if self.size else None)

    def _settle(self, timeout: float) -> None:
        """The attempt ended: wait for the upload in flight (its error is raised)."""
        if not self.uploads.wait(timeout):
            log.warning("a background save still uploads after %.1f s; the attempt ends "
                        "without it", timeout)


class Turn:
    """What one save call does: :attr:`save` says whether it saves; the save runs inside
    ``with turn:``, which times it, and for a preemption save waits for its commit (the
    leader, within the time left), agrees on the outcome and raises
    :class:`taskpoint.Preempted`."""

    def __init__(
        self, owner: BoundarySaves, *, save: bool, stop: tuple[int | None, object] | None = None
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
        if exc is None and started is not None:
            blocked = time.monotonic() - started
            if not owner.job_started:
                owner.last_save_s = blocked
            owner.schedule.saved(blocked_s=blocked, background=owner.job_started)
        if self._stop is None:
            return
        step, checkpoint = self._stop
        leader = owner.leads()
        committed, cause = exc is None, exc
        if committed and leader:
            try:
                committed = owner.uploads.wait(max(0.0, owner.boundary.budget()))
            except Exception as error:
                committed, cause = False, error
        outcome = (committed, None if cause is None else f"{type(cause).__name__}: {cause}")
        committed, failure = broadcast_from_zero(outcome) if owner.ranks else outcome
        reason = failure or "the save did not commit before the grace period's end"
        owner.boundary.stop(
            step, saved=committed, reason=reason, checkpoint=checkpoint, leader=leader,
            cause=cause,
        )

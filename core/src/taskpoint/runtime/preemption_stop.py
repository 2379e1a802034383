"""A preemption stop, the one sequence every adapter follows: a :class:`PreemptionStop` that each
holds as a field and calls from its framework's hooks (:class:`taskpoint.runtime.step_boundary.StepBoundary`,
Lightning's callback, the Trainer's)::

    stop = PreemptionStop(timeout=600)       # agreement: torch.distributed, or the adapter's
    if active:                               # taskpoint.preemption.save_on_preemption's rule
        stop.begin()                         # defer SIGTERM; make the agreement (every rank)
    ...
    if stop.requested():                     # at a step boundary, every rank: any signalled?
        decision = stop.decide(step, wait=wait_for_upload, estimate=last_save_s)
        if decision.saving:                  # every rank decides alike
            save()
            committed = stop.committed(wait_for_upload)
        stop.end(message, step=step, leader=rank == 0, checkpoint=ckpt)  # raises Preempted

:meth:`~PreemptionStop.decide` agrees on the earliest signalled rank's deadline (every rank
holds the notice from then on: :func:`taskpoint.preemption.relay`), waits for the upload in
flight until that deadline less :data:`MARGIN_S`, then agrees on what every rank saw: the
save is made only when every upload in flight finished and the slowest rank's save fits in
the time left less :data:`MARGIN_S`. How the ranks agree is an :class:`Agreement` (an or and
an element-wise minimum): by default a gloo group of ``torch.distributed``
(:class:`taskpoint.distributed.torch_coordination.AnyRank`), a process alone without one.

Every wait after the signal ends :data:`MARGIN_S` before the deadline, in every adapter.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

from taskpoint import preemption
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.checkpoint.job_mirror import JobMirror
from taskpoint.distributed.torch_coordination import AnyRank
from taskpoint.runtime import _life
from taskpoint.runtime.context import Preempted, ctx, in_task

__all__ = [
    "MARGIN_S",
    "Agreement",
    "Alone",
    "Decision",
    "PreemptionStop",
    "record_preempted",
    "wait_on_preemption",
    "why_not_saved",
    "within_grace",
]

log = logging.getLogger(__name__)

MARGIN_S = 1.0
"""Seconds of the grace period kept back, in every adapter, for ending the attempt after a
preemption save (the end record, the process exit): every wait after a preemption signal
(for the upload in flight, for the preemption save's commit, for an upload as training
fails) ends this long before the deadline, and a preemption save is made only when it fits
in the time left less this."""


def within_grace(timeout: float | None) -> float | None:
    """``timeout`` seconds (``None``: no limit), shortened to the grace period left less
    :data:`MARGIN_S` once a preemption signal came (0 once that has passed)."""
    notice = preemption.notice()
    if notice is None:
        return timeout
    left = max(0.0, notice.remaining() - MARGIN_S)
    return left if timeout is None else min(timeout, left)


@dataclass(frozen=True)
class _WaitOnSignal:
    """A task's ``on_preempt`` callback: :meth:`JobMirror.wait_on_signal` within the grace
    period. Equal for one job and timeout, so registering it again adds nothing."""

    job: JobMirror
    timeout: float | None

    def __call__(self) -> None:
        self.job.wait_on_signal(within_grace(self.timeout))


def wait_on_preemption(job: JobMirror, timeout: float | None, *, leader: bool) -> None:
    """Inside a task context, on the ``leader`` (the rank whose upload the attempt waits
    for), make a SIGTERM that is not turned into a save wait for ``job``'s upload in flight
    before the attempt ends (:meth:`JobMirror.wait_on_signal`: a timeout or failure is
    logged): at most ``timeout`` seconds (``None``: no limit), and never past the grace
    period less :data:`MARGIN_S` (:func:`within_grace`, as of the signal). Registered once
    per context, job and timeout (an adapter calls this at every training start); nothing
    outside a task context or on another rank."""
    task = ctx()
    if leader and task is not None:
        task.on_preempt(_WaitOnSignal(job, timeout))


def record_preempted(checkpoint: object, message: str, *, step: int | None) -> None:
    """Record the attempt's end as ``preempted`` (``"Preempted: <message>"``, at ``step``)
    in ``checkpoint``, where no runner records it: outside a taskpoint task, and only when
    ``checkpoint`` is a :class:`taskpoint.Checkpoint` (another system's checkpoint keeps
    its own records). Called by the rank that leads the job (world rank 0) as a
    preemption stops training; inside a task it does nothing.

    Raises:
        CheckpointStoreError: the record could not be written.
    """
    if not in_task() and isinstance(checkpoint, Checkpoint):
        checkpoint.mark_ended("preempted", f"Preempted: {message}", step=step)
        life = _life.current()
        if life is not None and life.checkpoint is not checkpoint:
            life.preempted(message, step=step)


class Agreement(Protocol):
    """How the ranks of one job agree at a preemption stop: the piece an adapter may supply
    from its framework (:class:`PreemptionStop`'s ``agreement``). Every rank calls each
    method at the same point; all get the same answer."""

    def any(self, flag: bool) -> bool:
        """``flag`` or'ed across the ranks."""
        ...

    def least(self, values: Sequence[float]) -> list[float]:
        """The element-wise minimum of ``values`` across the ranks."""
        ...

    def close(self) -> None:
        """Release what the agreement holds (a local call); idempotent."""
        ...


class Alone:
    """The :class:`Agreement` of a process that decides alone (its own values)."""

    def any(self, flag: bool) -> bool:
        """``flag`` itself."""
        return bool(flag)

    def least(self, values: Sequence[float]) -> list[float]:
        """``values`` themselves."""
        return [float(v) for v in values]

    def close(self) -> None:
        """Nothing to release."""


def _rank_vote(timeout: float) -> Agreement:
    """The default agreement: a gloo group of ``torch.distributed`` where one runs."""
    return AnyRank(timeout=timeout)


@dataclass(frozen=True)
class Decision:
    """What the ranks decided at a preemption stop: the same on every rank.

    Attributes:
        step: the step the training stopped at (``None``: not known here).
        deadline: ``time.monotonic()`` of the earliest signalled rank's deadline, on this
            rank's clock.
        reason: why no save is made (``""``: the save is made).
        signal: the signal's name (``"SIGTERM"``).
        agreed: the adapter's ``also`` flags, and'ed across the ranks.
    """

    step: int | None
    deadline: float
    reason: str
    signal: str = "SIGTERM"
    agreed: tuple[bool, ...] = ()

    @property
    def saving(self) -> bool:
        """Whether the preemption save is made."""
        return not self.reason

    def left(self) -> float:
        """Seconds left before the deadline (0 once past)."""
        return max(0.0, self.deadline - time.monotonic())

    def budget(self) -> float:
        """Seconds a wait may still take: :meth:`left` less :data:`MARGIN_S` (0 once past)."""
        return max(0.0, self.left() - MARGIN_S)


def why_not_saved(finished: bool, needed: float | None, left: float) -> str:
    """Why a preemption save is not made (``""``: it is), the rule every adapter follows:
    not when an upload in flight did not finish (``finished``), nor when the save does not
    fit in the time left less :data:`MARGIN_S`.

    Args:
        finished: whether every rank's upload in flight finished.
        needed: seconds the slowest rank's save should take (``None``: unknown: then only
            whether any time is left beyond the margin).
        left: seconds before the earliest deadline.
    """
    if not finished:
        return "the upload in flight did not finish in time"
    room = left - MARGIN_S
    if needed is not None and needed > room:
        return (
            f"a save takes about {needed:.1f}s and {left:.1f}s of the grace period are left "
            f"({MARGIN_S:g}s kept back)"
        )
    if room <= 0:
        return f"{left:.1f}s of the grace period are left ({MARGIN_S:g}s kept back)"
    return ""


class PreemptionStop:
    """The preemption stop every adapter holds as a field (see the module's documentation):
    defer the signal, agree across ranks that one came, finish the upload in flight within
    the grace period, decide whether the save fits, wait for its commit, record the end and
    raise :class:`taskpoint.Preempted`. The adapter keeps its framework's part: its hooks,
    the save itself, and the signal handlers its framework installs.

    Args:
        timeout: seconds an agreement waits for the other ranks.
        agreement: makes the :class:`Agreement` from ``timeout`` at :meth:`begin`; by
            default a gloo group of ``torch.distributed`` where a process group of several
            ranks runs (:class:`taskpoint.distributed.torch_coordination.AnyRank`), else
            :class:`Alone`.

    Raises:
        ValueError: ``timeout`` is not a positive number.
    """

    def __init__(
        self, *, timeout: float = 600.0, agreement: Callable[[float], Agreement] | None = None
    ) -> None:
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        self._timeout = float(timeout)
        self._make = agreement or _rank_vote
        self._scope = contextlib.ExitStack()
        self._agreement: Agreement | None = None
        self.decision: Decision | None = None
        """What the last :meth:`decide` found (``None`` before one)."""
        self.stopped: Preempted | None = None
        """The exception :meth:`end` raised (``None`` before)."""

    def __repr__(self) -> str:
        return f"PreemptionStop(active={self.active}, decision={self.decision!r})"

    @property
    def active(self) -> bool:
        """Whether a preemption signal is deferred to a stop (between :meth:`begin` and
        :meth:`close`)."""
        return self._agreement is not None

    def begin(self) -> bool:
        """Training starts with the save on preemption turned on: install taskpoint's
        signal handler, defer the signal (:func:`taskpoint.preemption.deferred`) and make
        the agreement (with ranks, a collective: every rank calls this at the same point).
        A stop begun before is closed first.

        Returns:
            Whether taskpoint's handler is installed (``False`` outside the main thread,
            with a WARNING: the signal then stops training only when another rank
            receives it).

        Raises:
            CheckpointCoordinationError: the agreement could not be made.
        """
        self.close()
        self.decision = self.stopped = None
        installed = preemption.install()
        if not installed:
            log.warning(
                "not in the main thread, so taskpoint cannot handle SIGTERM in this process: "
                "a SIGTERM here does not become a save (one another rank receives still "
                "stops training here)"
            )
        self._scope.enter_context(preemption.deferred())
        try:
            self._agreement = self._make(self._timeout)
        except BaseException:
            self.close()  # never leave the signal deferred past a failed start
            raise
        return installed

    def requested(self) -> bool:
        """Whether to stop at this step boundary: whether a preemption signal reached any
        rank (every rank calls it at the same boundaries); ``False`` when not begun or once
        decided.

        Raises:
            CheckpointCoordinationError: a rank did not arrive within the timeout.
        """
        if self._agreement is None or self.decision is not None:
            return False
        return self._agreement.any(preemption.requested())

    def decide(
        self,
        step: int | None,
        *,
        wait: Callable[[float], bool],
        estimate: Callable[[], float | None],
        also: Callable[[], Sequence[bool]] | None = None,
    ) -> Decision:
        """The stop, once :meth:`requested` said so (every rank, a collective): agree on the
        earliest deadline (a rank the signal missed holds the notice too), ``wait`` for
        this rank's upload in flight within it, then agree whether the save is made: only
        when every rank's upload finished and the slowest rank's ``estimate`` fits in the
        time left less :data:`MARGIN_S`.

        Args:
            step: the step training stops at.
            wait: waits at most the given seconds for this rank's upload in flight and
                says whether none runs any more.
            estimate: seconds this rank's save should take, to the commit (``None``:
                unknown); asked once the wait is over.
            also: flags of the adapter's own, asked after the wait, and'ed across the ranks
                into :attr:`Decision.agreed`.

        Returns:
            The decision, the same on every rank (also kept as :attr:`decision`).

        Raises:
            CheckpointCoordinationError: a rank did not arrive within the timeout.
        """
        agreement = self._agreement or Alone()
        own = preemption.notice()
        (first,) = agreement.least([own.remaining() if own is not None else math.inf])
        if not math.isfinite(first):  # no rank holds a notice: a stop asked for otherwise
            first = preemption.grace_period()
        deadline = time.monotonic() + max(0.0, first)
        notice = preemption.relay(max(0.0, first))
        finished = wait(max(0.0, deadline - time.monotonic() - MARGIN_S))
        mine = estimate()
        flags = [float(bool(f)) for f in (also() if also is not None else ())]
        seen = agreement.least(
            [deadline - time.monotonic(), -(mine or 0.0), float(bool(finished)), *flags]
        )
        needed = -seen[1]
        decision = Decision(
            step, deadline, why_not_saved(bool(seen[2]), needed if needed > 0 else None, seen[0]),
            notice.signal, tuple(bool(f) for f in seen[3:]),
        )
        self.decision = decision
        return decision

    def committed(self, wait: Callable[[float], bool]) -> bool:
        """After the preemption save (every rank, a collective and a barrier: no rank ends
        before the commit is known): ``wait`` for this rank's upload, within the decided
        deadline less :data:`MARGIN_S`, and agree whether every rank's committed.

        Raises:
            CheckpointCoordinationError: a rank did not arrive within the timeout.
        """
        budget = self.decision.budget() if self.decision is not None else within_grace(None)
        done = bool(wait(math.inf if budget is None else budget))
        return done if self._agreement is None else not self._agreement.any(not done)

    def end(
        self,
        message: str,
        *,
        step: int | None,
        leader: bool,
        checkpoint: object = None,
        cause: BaseException | None = None,
    ) -> NoReturn:
        """End the training for the preemption: the ``leader`` (world rank 0) logs
        ``message`` and, outside a task, records the attempt's end as preempted in
        ``checkpoint`` (:func:`record_preempted`), before any rank can end; then the stop
        closes and raises.

        Raises:
            Preempted: always, with ``message``; from ``cause`` when given.
        """
        if leader:
            log.warning("%s", message)
            record_preempted(checkpoint, message, step=step)
        self.stopped = Preempted(message)
        self.close()
        raise self.stopped from cause

    def close(self) -> None:
        """Leave the deferral and release the agreement (local calls); idempotent. The
        decision stays, for the hooks that run after the stop."""
        self._scope.close()
        agreement, self._agreement = self._agreement, None
        if agreement is not None:
            with contextlib.suppress(Exception):
                agreement.close()

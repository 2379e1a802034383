"""SIGTERM as a save for ``TaskpointModelCheckpoint``: every rank stops at one step
boundary, Lightning's own checkpoint is saved there and committed, and the attempt ends
with :class:`taskpoint.Preempted`.

Whether SIGTERM becomes a save is :func:`taskpoint.preemption.save_on_preemption`'s rule
(the callback's ``save_on_preemption`` argument, then ``TASKPOINT_SAVE_ON_PREEMPTION``, then
"inside a taskpoint task or a process of the environment contract"), decided on global rank zero and shared with every rank at
setup, so all ranks take part in the vote or none does.

How it composes with Lightning's own SIGTERM handling (its ``_SignalConnector``): at setup,
before Lightning registers its handlers, taskpoint's handler is installed and a SIGTERM
only sets the notice (:func:`taskpoint.preemption.deferred`). Lightning then registers a
handler that calls its own first (it sets ``trainer.received_sigterm``, forwards the
signal to the processes its launcher started and, since Lightning 2.5, broadcasts from
rank 0 inside the signal handler), then the handler it found. Left in place, Lightning
raises ``SIGTERMException`` at the next ``on_advance_end`` or, with several processes, at
the start of the next batch: wherever the signal came in the batch, possibly before any
hook could save, on the signalled ranks only when the signal did not reach rank 0, and
its collective inside the handler runs out of step with the other ranks. So while fit
trains with the save turned on, the handler Lightning found (taskpoint's) is put back at
``on_train_start``; Lightning's teardown restores the same one. At every step boundary
(``on_train_batch_end`` once the gradients of the step are applied, and ``on_train_end``)
the ranks vote (:class:`taskpoint.distributed.torch_coordination.AnyRank`, on a gloo group of its
own: no GPU synchronisation); the first vote after the signal stops all of them there.

The stop: every rank waits (bounded) for its upload in flight, the ranks agree on the
earliest deadline and on the slowest expected save, ranks that were not signalled hold
the notice too (:func:`taskpoint.preemption.relay`), and then, when the save fits in the
time left, the callback saves and mirrors as it does for any save (the newest
``last.ckpt``, see the callback) and every rank waits for the commit before raising
:class:`taskpoint.Preempted`. When it does not fit, the previous checkpoint stays (commits
are atomic), a WARNING says so and the attempt's record says ``missed``.

SLURM: Lightning's ``SLURMEnvironment(auto_requeue=True)`` (its default under SLURM) keeps
its own requeue signal, SIGUSR1 (``--signal=USR1@<seconds>``), which taskpoint leaves
alone: from inside that signal handler, wherever training is, it saves
``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` (outside ``dirpath``, so not mirrored) and runs
``scontrol requeue``; a requeued job resumes from that file only when ``ckpt_path`` is
``None`` and the file is on its disk. SIGTERM (``scancel``, preemption, ``--signal=TERM@<s>``
before the time limit; SIGKILL follows ``KillWait`` seconds later) is taskpoint's: set
``TASKPOINT_GRACE_PERIOD`` to that time. For one checkpoint, the mirrored one, requeue with
SLURM (``--requeue``, ``PreemptMode=REQUEUE``) and give the Trainer
``plugins=[SLURMEnvironment(auto_requeue=False)]``; ``SLURM_RESTART_COUNT`` numbers the
attempts and ``resume_ckpt_path`` restores from the store.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import taskpoint
from taskpoint import preemption
from taskpoint.distributed.torch_coordination import AnyRank
from taskpoint.runtime import step_boundary

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MARGIN_S", "Preemption"]

log = logging.getLogger(__name__)

MARGIN_S = 1.0
"""Seconds kept free before the deadline: a save must fit in what is left after it."""


class Saver(Protocol):
    """What a stop asks of the callback."""

    def _preemption_first(self) -> None:
        """Drop a mirror waiting behind the upload in flight: the preemption save, of the
        same folder and newer, goes first."""
        ...

    def _preemption_wait(self, trainer: pl.Trainer, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for this rank's upload in flight; whether none
        runs any more (a failed one is logged and counts as done)."""
        ...

    def _preemption_estimate(self) -> float:
        """Seconds this rank expects a save to take, to the commit (0 when unknown)."""
        ...

    def _preemption_flagged(self) -> bool:
        """Whether the last mirror started after the notice (its commit then counts as
        the preemption save)."""
        ...

    def _preemption_save(self, trainer: pl.Trainer, *, again: bool) -> str | None:
        """Save and start mirroring (every rank); the file written, ``None`` when a save at
        this step exists already (mirrored once more when ``again``)."""
        ...

    def _preemption_mirrored(self) -> bool:
        """Whether the folder's mirror has started since its last change (always on a rank
        with no part in it); ``False`` when it could not be mirrored yet."""
        ...


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Preemption:
    """One fit's SIGTERM handling (see the module's documentation).

    Args:
        active: whether SIGTERM becomes a save (agreed by every rank).
        timeout: seconds a vote waits for the other ranks.
    """

    def __init__(self, active: bool, timeout: float) -> None:
        self.active = active
        self._timeout = timeout
        self._deferral = contextlib.ExitStack()
        self._before: Any = None  # the SIGTERM handler Lightning finds, and restores
        self._vote: AnyRank | None = None
        self._stopped: taskpoint.Preempted | None = None

    @classmethod
    def start(cls, trainer: pl.Trainer, choice: bool | None, timeout: float) -> Preemption:
        """Set up at the callback's ``setup`` (every rank, before Lightning registers its
        handlers): decide, install taskpoint's handler, defer, make the vote.

        Raises:
            ValueError: ``TASKPOINT_SAVE_ON_PREEMPTION`` or ``TASKPOINT_GRACE_PERIOD`` is
                set to something unusable.
        """
        active = preemption.save_on_preemption(
            choice, in_task=taskpoint.runtime.context.supervised()
        )
        if trainer.world_size > 1:
            active = bool(trainer.strategy.broadcast(active, src=0))  # rank zero's rule
        self = cls(active, timeout)
        if active:
            if not preemption.install():
                log.warning(
                    "rank %d: not in the main thread, so SIGTERM cannot be handled here; it "
                    "stops training when another rank receives it", trainer.global_rank,
                )
            self._deferral.enter_context(preemption.deferred())
            try:
                self._vote = AnyRank(timeout=timeout)
            except BaseException:
                self.close()  # never leave SIGTERM deferred past this fit
                raise
        if _main_thread():
            self._before = signal.getsignal(signal.SIGTERM)
        return self

    def take_over(self) -> None:
        """At ``on_train_start``, once Lightning has registered its handlers: put back the
        handler it found (taskpoint's), so a SIGTERM only sets the notice until the vote."""
        if not self.active or self._before is None or not _main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not self._before:
            signal.signal(signal.SIGTERM, self._before)
            log.debug("SIGTERM: Lightning's handler set aside while taskpoint saves on it")

    def requested(self) -> bool:
        """Whether to stop here: a collective vote of every rank (call at the same step
        boundaries on all of them); ``False`` when not active or already stopped.

        Raises:
            taskpoint.CheckpointCoordinationError: a rank did not vote within the timeout.
        """
        if not self.active or self._stopped is not None or self._vote is None:
            return False
        return self._vote(preemption.requested())

    def raised(self, exception: BaseException) -> bool:
        """Whether ``exception`` is this stop's :class:`taskpoint.Preempted`."""
        return self._stopped is not None and exception is self._stopped

    def bound(self, timeout: float | None) -> float | None:
        """``timeout`` shortened to the time left before the notice's deadline, if any."""
        notice = preemption.notice()
        if notice is None:
            return timeout
        left = max(0.0, notice.remaining() - MARGIN_S)
        return left if timeout is None else min(timeout, left)

    def stop(
        self, trainer: pl.Trainer, saver: Saver, *, where: str, checkpoint: object = None
    ) -> None:
        """Save at this step boundary (every rank), wait for the commit, raise.

        Outside a task, where no runner records the attempt, global rank zero records its
        end as preempted in ``checkpoint`` when it is a :class:`taskpoint.Checkpoint`
        (before any rank can end: under torchrun the others are then torn down).

        Raises:
            taskpoint.Preempted: always, once the stop is done (saved or not).
        """
        step = trainer.global_step
        own = preemption.notice()
        saver._preemption_first()
        first = saver._preemption_wait(
            trainer, max(0.0, (own.remaining() if own else preemption.grace_period()) - MARGIN_S)
        )
        left, needed, finished, flagged = self._agree(
            trainer, own.remaining() if own else math.inf, saver._preemption_estimate(),
            first, saver._preemption_flagged(),
        )
        started = time.monotonic()
        if not math.isfinite(left):
            left = preemption.grace_period()
        deadline = started + left  # the earliest rank's, as this rank's clock tells it
        notice = preemption.relay(left)
        saved: str | None = None
        # Every rank decides from the same agreed values: they all save, or none does.
        if not finished:
            outcome = (
                "missed: the upload in flight did not finish in time (the store keeps the "
                "checkpoint before it)"
            )
        elif left - MARGIN_S < needed:
            outcome = (
                f"missed: a save takes about {needed:.1f}s and {left:.1f}s are left (the "
                "store keeps the previous checkpoint)"
            )
        else:
            saved = saver._preemption_save(trainer, again=not flagged)
            done = saver._preemption_mirrored() and saver._preemption_wait(
                trainer, max(0.0, deadline - time.monotonic() - MARGIN_S)
            )
            # Also a barrier: no rank ends (torchrun then stops the others) before the commit.
            committed = self._vote is None or not self._vote(not done)
            what = f"saved {saved}" if saved else "the save at this step"
            outcome = (
                f"{what} and committed it in {time.monotonic() - started:.1f}s"
                if committed else
                f"missed: {what} did not commit within the grace period (the store keeps "
                "the previous checkpoint)"
            )
        message = f"{notice.signal} received: stopped at step {step} ({where}); {outcome}"
        if trainer.is_global_zero:
            log.warning("%s", message)
            step_boundary.record_preempted(checkpoint, message, step=step)
        self._stopped = taskpoint.Preempted(message)
        self.close()
        raise self._stopped

    def _agree(
        self, trainer: pl.Trainer, remaining: float, estimate: float, finished: bool,
        flagged: bool,
    ) -> tuple[float, float, bool, bool]:
        """The earliest deadline's seconds left, the slowest save, whether every upload in
        flight finished and every last mirror started after the notice: the same on every
        rank (one reduction, on Lightning's process group, once per stop)."""
        if trainer.world_size < 2:
            return remaining, estimate, finished, flagged
        import torch

        values = torch.tensor(
            [remaining, -estimate, float(finished), float(flagged)], dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        least = trainer.strategy.reduce(values, reduce_op="min").cpu().tolist()
        return float(least[0]), -float(least[1]), bool(least[2]), bool(least[3])

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """While inside (the wait for an upload when training fails), a SIGTERM only sets
        the notice: Lightning's handler, whose collective would raise from the handler
        once a rank is gone, is set aside, and taskpoint's is on top."""
        if not _main_thread():
            yield
            return
        if self._before is not None and signal.getsignal(signal.SIGTERM) is not self._before:
            signal.signal(signal.SIGTERM, self._before)  # Lightning's teardown restores it too
        preemption.install()
        with preemption.deferred():
            yield

    def close(self) -> None:
        """End the deferral and the vote (each rank on its own); idempotent."""
        self._deferral.close()
        vote, self._vote = self._vote, None
        if vote is not None:
            vote.close()

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

The stop is core's :class:`taskpoint.runtime.preemption_stop.PreemptionStop`, the sequence every
adapter shares (see there); its agreement is Lightning's: the vote above, and the strategy's
``reduce`` for the deadline, the slowest save and whether every upload finished. When the
save fits in the time left, the callback saves and mirrors as it does for any save (the
newest ``last.ckpt``, see the callback) and every rank waits for the commit before raising
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
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from taskpoint.integration import (
    AnyRank,
    PreemptionStop,
    deferred,
    install,
    saves_on_preemption,
    within_grace,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Preemption"]

log = logging.getLogger(__name__)


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


class _StrategyAgreement:
    """The ranks of a fit agree through Lightning: the vote on a gloo group of its own, the
    minimum through the strategy's ``reduce`` (its process group)."""

    def __init__(self, trainer: pl.Trainer, timeout: float) -> None:
        self._trainer = trainer
        self._vote = AnyRank(timeout=timeout)

    def any(self, flag: bool) -> bool:
        return self._vote(flag)

    def least(self, values: Sequence[float]) -> list[float]:
        if self._trainer.world_size < 2:
            return [float(v) for v in values]
        import torch

        tensor = torch.tensor(
            list(values), dtype=torch.float64, device=self._trainer.strategy.root_device
        )
        least = self._trainer.strategy.reduce(tensor, reduce_op="min")
        return [float(v) for v in least.cpu().tolist()]

    def close(self) -> None:
        self._vote.close()


class Preemption:
    """One fit's SIGTERM handling (see the module's documentation).

    Args:
        active: whether SIGTERM becomes a save (agreed by every rank).
        stop: the shared stop sequence.
    """

    def __init__(self, active: bool, stop: PreemptionStop) -> None:
        self.active = active
        self._stop = stop
        self._before: Any = None  # the SIGTERM handler Lightning finds, and restores

    @classmethod
    def start(cls, trainer: pl.Trainer, choice: bool | None, timeout: float) -> Preemption:
        """Set up at the callback's ``setup`` (every rank, before Lightning registers its
        handlers): decide, install taskpoint's handler, defer, make the vote.

        Raises:
            ValueError: ``TASKPOINT_SAVE_ON_PREEMPTION`` or ``TASKPOINT_GRACE_PERIOD`` is
                set to something unusable.
        """
        active = saves_on_preemption(choice)
        if trainer.world_size > 1:
            active = bool(trainer.strategy.broadcast(active, src=0))  # rank zero's rule
        self = cls(active, PreemptionStop(
            timeout=timeout, agreement=lambda t: _StrategyAgreement(trainer, t)
        ))
        if active and not self._stop.begin():
            log.warning(
                "rank %d: not in the main thread, so SIGTERM cannot be handled here; it "
                "stops training when another rank receives it", trainer.global_rank,
            )
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
        return self._stop.requested()

    def raised(self, exception: BaseException) -> bool:
        """Whether ``exception`` is this stop's :class:`taskpoint.Preempted`."""
        return self._stop.stopped is not None and exception is self._stop.stopped

    def bound(self, timeout: float | None) -> float | None:
        """``timeout`` shortened to the time left before the notice's deadline, if any."""
        return within_grace(timeout)

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
        saver._preemption_first()
        decision = self._stop.decide(
            step, wait=lambda timeout: saver._preemption_wait(trainer, timeout),
            estimate=saver._preemption_estimate, also=lambda: [saver._preemption_flagged()],
        )
        started = time.monotonic()
        if not decision.saving:
            outcome = f"missed: {decision.reason} (the store keeps the previous checkpoint)"
        else:
            saved = saver._preemption_save(trainer, again=not decision.agreed[0])
            # Also a barrier: no rank ends (torchrun then stops the others) before the commit.
            committed = self._stop.committed(
                lambda timeout: saver._preemption_mirrored()
                and saver._preemption_wait(trainer, timeout)
            )
            what = f"saved {saved}" if saved else "the save at this step"
            outcome = (
                f"{what} and committed it in {time.monotonic() - started:.1f}s"
                if committed else
                f"missed: {what} did not commit within the grace period (the store keeps "
                "the previous checkpoint)"
            )
        self._stop.end(
            f"{decision.signal} received: stopped at step {step} ({where}); {outcome}",
            step=step, leader=trainer.is_global_zero, checkpoint=checkpoint,
        )

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
        install()
        with deferred():
            yield

    def close(self) -> None:
        """End the deferral and the vote (each rank on its own); idempotent."""
        self._stop.close()

"""SIGTERM as a save for ``TaskpointModelCheckpoint``: every rank stops at one step
boundary (``on_train_batch_end`` once the step's gradients are applied, or
``on_train_end``), Lightning's own checkpoint is saved there and committed, and the attempt
ends with :class:`taskpoint.Preempted` (that save: ``Mirroring._preemption_stop`` in
:mod:`taskpoint_lightning._mirroring`). The sequence is core's
:class:`taskpoint.runtime.preemption_stop.PreemptionStop`, its ranks agreeing on a gloo
group of its own (no GPU synchronisation); whether SIGTERM becomes a save is
:func:`taskpoint.preemption.save_on_preemption`'s rule, global rank zero's for all.

Lightning's own SIGTERM handler would raise ``SIGTERMException`` mid-batch on the
signalled ranks only (its broadcast inside the handler out of step with the others), so
taskpoint's handler, installed at setup before Lightning's, is put back on top at
``on_train_start`` and only sets the notice. SIGUSR1 (SLURM's requeue) stays Lightning's:
see the preemption guide (``docs/preemption.md``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from taskpoint.integration import (
    PreemptionStop,
    deferred,
    install,
    saves_on_preemption,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Preemption"]

log = logging.getLogger(__name__)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Preemption:
    """One fit's SIGTERM handling (see the module's documentation): ``active``, whether
    SIGTERM becomes a save (agreed by every rank), through core's ``stop`` sequence."""

    def __init__(self, active: bool, stop: PreemptionStop) -> None:
        self.active = active
        self.sequence = stop
        """Core's stop sequence: its vote (``requested``), the callback's preemption save
        (see ``Mirroring._preemption_stop``) and its end (``close``)."""
        self._before: Any = None  # the SIGTERM handler Lightning finds, and restores

    @classmethod
    def start(cls, trainer: pl.Trainer, choice: bool | None, timeout: float) -> Preemption:
        """Set up at ``setup`` (every rank, before Lightning registers its handlers).

        Raises:
            ValueError: ``TASKPOINT_SAVE_ON_PREEMPTION`` or ``TASKPOINT_GRACE_PERIOD`` is
                unusable.
        """
        active = saves_on_preemption(choice)
        if trainer.world_size > 1:
            active = bool(trainer.strategy.broadcast(active, src=0))  # rank zero's rule
        self = cls(active, PreemptionStop(timeout=timeout))
        if active:
            self.sequence.begin()  # a collective: every rank
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

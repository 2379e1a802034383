"""The run records a :class:`~taskpoint.Checkpoint` writes and reads for its runner.

:class:`Records` gives ``Checkpoint`` its record methods: ``mark_started`` and
``mark_ended`` for the attempt saving through it (and ``record_interval``, the save interval
it chose), ``mark_finished`` and ``status`` for the action as a whole, ``attempts`` for the
run's attempts. The records and their keys are :mod:`taskpoint.format.history`'s; what
is decided here is what an attempt's end record says about its preemption save.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from taskpoint import preemption, progress
from taskpoint.errors import CheckpointError
from taskpoint.format import history
from taskpoint.format._catalog import Catalog
from taskpoint.store.store import Store

__all__ = ["Records"]


class Records:
    """The run-record methods of :class:`~taskpoint.Checkpoint`, which inherits them.

    It holds nothing of its own: it works through the collaborators ``Checkpoint``'s
    constructor makes (the store, its catalog, the attempt).
    """

    _store: Store
    _catalog: Catalog
    _attempt: history.Attempt

    def mark_started(self) -> None:
        """Record that this checkpoint's attempt started, claiming its number from the
        store first when it has none, and record earlier attempts that died without an
        end record (see :meth:`taskpoint.format.history.Attempt.started`).

        Raises:
            CheckpointStoreError: the store failed while claiming a number (writing the
                record for a given number is best effort, like every run record).
        """
        self._attempt.started()

    def mark_ended(
        self,
        outcome: history.Outcome,
        error: str | None = None,
        *,
        step: int | None = None,
        traceback: str | None = None,
    ) -> None:
        """Record how this checkpoint's attempt ended; nothing if it never claimed one.

        The record names the training step the attempt reached (``step``, by default the
        one last given to :func:`taskpoint.report_step` in this process) and, for an attempt
        that was preempted or received a preemption signal, whether a save made after the
        signal committed; ``traceback`` is the error's traceback (kept to
        :data:`taskpoint.format.history.TRACEBACK_CHARS` characters). Best effort, like every run record (see :mod:`taskpoint.format.history`).

        Raises:
            ValueError: ``outcome`` is not one of :data:`taskpoint.format.history.OUTCOMES`.
        """
        if self._attempt.number is None:
            return
        save: history.PreemptionSave | None = None
        if outcome == "preempted" or preemption.requested():
            save = "committed" if self._preemption_saved() else "missed"
        self._attempt.ended(
            outcome, error, step=progress.current_step() if step is None else step,
            preemption_save=save, traceback=traceback,
        )

    def _preemption_saved(self) -> bool:
        """Whether this attempt committed a save made after its preemption signal."""
        try:
            committed = self._catalog.newest_first()
        except CheckpointError:
            return False  # unknown reads as missed: the record errs on the side of caution
        return any(m.preemption and m.attempt == self._attempt.number for m in committed)

    def mark_finished(self, state: str, *, attempts: int) -> None:
        """Record that the action ended (``"succeeded"`` or ``"failed"``) after ``attempts``.

        Best effort: a store failure is logged, not raised, so it never hides the task's
        own outcome. ``taskpoint gc``/``rm`` treat actions without this record as unfinished.
        """
        history.record_finished(self._store, state, attempts)

    def attempts(self) -> list[history.AttemptRecord]:
        """The run's attempt records (this checkpoint's attempt's too, once claimed),
        ascending: when each started and how it ended (see
        :func:`taskpoint.format.history.read_attempts`).

        Raises:
            CheckpointStoreError: the store failed to list the records.
        """
        return history.read_attempts(self._store)

    def record_interval(self, choice: Mapping[str, Any]) -> None:
        """Record the save interval this checkpoint's attempt chose and its inputs
        (:meth:`taskpoint.IntervalChoice.to_record`), for ``taskpoint show``; nothing if
        the attempt has no number yet. Best effort, like every run record."""
        if self._attempt.number is not None:
            history.record_interval(self._store, self._attempt.number, dict(choice))

    def status(self) -> dict[str, Any] | None:
        """The record :meth:`mark_finished` wrote, or ``None`` while the action is unfinished.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointFormatError: a newer taskpoint wrote the record.
        """
        return history.read_status(self._store)

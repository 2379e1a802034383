"""The save at an exception (``TaskpointTrainerCallback(save_on_exception=True)``): when an
exception ends ``trainer.train()``, the Trainer writes ``checkpoint-N`` of the last step it
completed, if nothing was written since, and the callback uploads it; the retry resumes at
N instead of at the last checkpoint the save strategy wrote.

``on_step_end`` is a step boundary: the optimizer and the scheduler have stepped and the
gradients are cleared. There a :class:`FailureSave` notes the model's parameters and
buffers, for core's :class:`taskpoint.integration.WriteWatch` to tell whether they were
written since (with a pre-hook on the optimizer's ``step``), and the global RNGs' states.
An exception out of ``train()`` later (in the next step's data loading, forward or backward
pass, in an evaluation, in a callback) finds whether the model is still as noted. If it
is, the RNGs are set back to the boundary's (the failed step may have drawn dropout masks
already), so that the ``rng_state.pth`` the Trainer writes is the one a save at the
boundary would have written, and ``Trainer._save_checkpoint`` writes ``checkpoint-N``
(with the optimizer, the scheduler and the trainer state, and the ``save_total_limit``
rotation) as the save strategy does. Otherwise nothing is saved and a warning says what
changed.

It saves nothing either when ``checkpoint-N`` was the save strategy's own save, after a
store error (the same store would fail again), under ``torch.distributed`` (a failing rank
cannot run a save's collectives, and another rank's death shows as an exception), for
:class:`taskpoint.Preempted` (its own save ran) and for what is not an ``Exception``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from taskpoint import CheckpointError, Preempted
from taskpoint.integration import (
    WriteWatch,
    is_distributed,
    module_tensors,
    reset_rng,
    snapshot_rng,
)
from transformers import TrainerState

__all__ = ["FailureSave"]

log = logging.getLogger(__name__)


class FailureSave:
    """Has the Trainer write ``checkpoint-N`` at an exception (see the module docs)."""

    def __init__(self) -> None:
        self._writes = WriteWatch()
        self._model: Any = None
        self._modules: list[Any] = []  # the model's modules, found once per model
        self._step: int | None = None
        self._rng: tuple[Any, ...] | None = None
        self._saved = False

    def note(self, state: TrainerState, model: Any, optimizer: Any) -> None:
        """A step boundary (``on_step_end``): remember the model as it is now. Costs a pass
        over its tensors and a copy of the RNG states; under ``torch.distributed``, where
        nothing is saved at a failure (:meth:`at_failure` says why), only the step."""
        if model is None:
            return
        self._step, self._saved = state.global_step, False
        if is_distributed():
            return
        if model is not self._model:
            self._model, self._modules = model, list(model.modules())
        if optimizer is not None:
            self._writes.watch(optimizer)
        self._writes.note(module_tensors(self._modules))
        self._rng = snapshot_rng()

    def saved(self, step: int) -> None:
        """The Trainer saved ``checkpoint-<step>`` itself (``on_save``)."""
        if step == self._step:
            self._saved = True

    def at_failure(
        self, exc: BaseException, trainer: Any, before_write: Callable[[int], object]
    ) -> int | None:
        """``exc`` is leaving ``trainer.train()``: have the Trainer write the checkpoint of
        the last boundary if the model is still as it was there, ``before_write(step)``
        called first. Logs what it did; raises nothing.

        Returns:
            The step of the ``checkpoint-N`` written, or ``None`` when none was.
        """
        step, self._step = self._step, None
        if step is None or self._saved or not isinstance(exc, Exception) or isinstance(exc, Preempted):
            return None
        why = self._unsaved_because(exc, trainer, step)
        if why is not None:
            log.warning(
                "no checkpoint at the failure (%s): %s; the retry resumes at the last "
                "committed checkpoint", type(exc).__name__, why,
            )
            return None
        assert self._rng is not None
        reset_rng(self._rng)
        try:
            before_write(step)
            trainer._save_checkpoint(trainer.model, trial=None)
        except Exception as error:
            log.warning("writing checkpoint-%d at the failure (%s) failed: %s: %s",
                        step, type(exc).__name__, type(error).__name__, error)
            return None
        return step

    def _unsaved_because(self, exc: BaseException, trainer: Any, step: int) -> str | None:
        """Why no checkpoint is written at this failure, or ``None`` when one is."""
        if isinstance(exc, CheckpointError):
            return "the checkpoint store failed, and would fail this save too"
        if is_distributed():
            return "under torch.distributed a failing rank cannot run a save's collectives"
        written = self._writes.written(module_tensors(self._modules))
        if written is not None:
            return f"since step {step} ended, {written}"
        if trainer.model is not self._model or trainer.state.global_step != step:
            return f"the Trainer moved on from step {step}"
        return None

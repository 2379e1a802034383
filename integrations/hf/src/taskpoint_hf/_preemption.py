"""The callback's SIGTERM and exception handling, in one of three modes chosen at
``on_train_begin`` by :func:`taskpoint.preemption.save_on_preemption` (the argument,
``TASKPOINT_SAVE_ON_PREEMPTION``, else inside a task or with ``enable_jit_checkpoint``):

``"save"``
    Core's :class:`taskpoint.runtime.preemption_stop.PreemptionStop`: at each
    ``on_step_end`` the ranks vote, and once one was signalled the Trainer is told to save
    its own ``checkpoint-N`` and stop (its mid-step just-in-time checkpoint is switched
    off: this save, at a step boundary, resumes exactly); ``on_train_end`` waits for the
    upload within the grace period and raises :class:`taskpoint.Preempted`.
``"jit"``
    The switch is off but the Trainer has just-in-time checkpoints: its handler runs under
    taskpoint's, its checkpoint is uploaded at ``on_train_end``, and a save in the middle
    of a step is named at WARNING (the resume will not be exact).
``"wait"``
    Inside a task context SIGTERM waits for the upload in flight (``preempt_timeout``).

In every mode, training that ends by an exception waits for this rank's upload in flight
(no collective: the failure may be another rank's death) before the exception leaves
``train()``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, Literal

from taskpoint.integration import (
    Decision,
    JobMirror,
    PreemptionStop,
    deferred,
    install,
    requested,
    saves_on_preemption,
    wait_on_preemption,
    within_grace,
)
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

__all__ = ["Mode", "Preemption"]

log = logging.getLogger(__name__)

Mode = Literal["save", "jit", "wait"]
_MID_STEP = {
    "on_step_begin": (
        "at on_step_begin, after step {step}'s batch was fetched",
        "a resume from it repeats an uninterrupted run only if fetching a batch draws no "
        "random numbers (a masking data collator does)",
    ),
    "on_pre_optimizer_step": (
        "at on_pre_optimizer_step, in the middle of step {step} (after its forward and "
        "backward passes, before the optimizer update)",
        "a resume from it will not repeat an uninterrupted run exactly (the step's random "
        "numbers were drawn before it was saved)",
    ),
}
"""The hooks where transformers' JIT callback saves before a step boundary: where that
is, and what it means for a resume from it."""

def _jit_callbacks(handler: CallbackHandler | None) -> list[Any]:
    """The Trainer's armed just-in-time checkpoint callbacks (transformers >= 5.0)."""
    if handler is None:
        return []
    return [
        c for c in handler.callbacks
        if type(c).__name__ == "JITCheckpointCallback" and getattr(c, "jit_manager", None)
    ]


def _disarm(callback: Any) -> None:
    """Switch a ``JITCheckpointCallback`` off: its hooks act only while it has a manager,
    and its SIGTERM handler, when on top, gives way to the one it replaced."""
    manager = callback.jit_manager
    callback.jit_manager = None
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if getattr(current, "__self__", None) is manager:
        original = getattr(manager, "_original_sigterm_handler", None)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if original is None else original)


class Preemption:
    """The callback's SIGTERM and exception handling (see the module docstring).

    Args:
        choice: the callback's ``save_on_preemption`` argument.
        job: the callback's mirror (its ``timeout`` is the vote's).
        wait_timeout: seconds an ending without a deadline waits for the upload in flight
            (``None``: no limit).
    """

    def __init__(self, choice: bool | None, job: JobMirror, *, wait_timeout: float | None) -> None:
        self.choice = choice
        self.job = job
        self.wait_timeout = wait_timeout
        self.mode: Mode = "wait"
        self.stop: Decision | None = None
        self._stack = contextlib.ExitStack()  # "jit" mode's deferral
        self._stop = PreemptionStop(timeout=job.timeout)
        self._ended = True  # no training under way
        self._jit_seen = self._jit_settled = False

    def begin(self, handler: CallbackHandler | None, state: TrainerState, *, guarded: bool) -> None:
        """Choose the mode and put it in place (a collective in ``"save"`` mode: every rank
        calls this at ``on_train_begin``). ``guarded``: whether this ``train()`` call is
        wrapped, so an exception out of it leaves the deferral; without it SIGTERM is not
        deferred (the mode falls back to ``"wait"``, or ``"jit"`` without deferral).

        Raises:
            ValueError: ``TASKPOINT_SAVE_ON_PREEMPTION`` or ``TASKPOINT_GRACE_PERIOD`` hold
                something unusable.
        """
        self.close()
        self.stop, self._ended = None, False
        self._jit_seen = self._jit_settled = False
        jits = _jit_callbacks(handler)
        save = saves_on_preemption(self.choice, restarted=bool(jits))
        if save and not guarded:
            if state.is_world_process_zero:
                log.warning(
                    "TaskpointTrainerCallback was added after the Trainer was built "
                    "(add_callback): this train() call cannot save on SIGTERM, nor wait for "
                    "its upload when it ends by an exception; pass the callback in "
                    "Trainer(callbacks=[...])"
                )
            save = False
        if save:
            self.mode = "save"
            for jit in jits:  # its handler gives way before taskpoint's goes on top
                _disarm(jit)
            if jits and state.is_world_process_zero:
                log.info(
                    "enable_jit_checkpoint: on SIGTERM taskpoint saves checkpoint-N at the next "
                    "step boundary (an exact resume) instead of transformers' save in the "
                    "middle of a step"
                )
            self._stop.begin()  # a collective: every rank
        elif jits:
            self.mode = "jit"
            install()  # on top of the Trainer's handler, which it calls
            if guarded:  # else a task's fallback ends the attempt at once, as before
                self._stack.enter_context(deferred())
        else:
            self.mode = "wait"
            wait_on_preemption(self.job, self.wait_timeout, leader=state.is_world_process_zero)

    def at_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        estimate: Callable[[], float | None],
    ) -> None:
        """In ``"save"`` mode, vote; once any rank has the notice, stop here (every rank),
        saving if the save fits in the grace period left: ``estimate()`` is how long the
        last save took (from the Trainer's write to the commit)."""
        if self.mode != "save" or self.stop is not None or not self._stop.requested():
            return
        stop = self.stop = self._stop.decide(
            state.global_step, wait=lambda timeout: self.job.settle(timeout) is not False,
            estimate=estimate,
        )
        control.should_training_stop = True
        control.should_save = stop.saving
        if stop.saving and args.save_strategy == "best":
            control.should_evaluate = False  # its verdict would decide the save
        if not state.is_world_process_zero:
            return
        if not stop.saving:
            log.warning(
                "%s: stopping at step %d WITHOUT saving: %s; the next attempt resumes "
                "from the last committed checkpoint", stop.signal, stop.step, stop.reason,
            )
        else:
            log.warning(
                "%s: stopping at step %d and saving checkpoint-%d, %.1fs of the grace "
                "period left", stop.signal, stop.step, stop.step, stop.left(),
            )

    def at_epoch_end(self, state: TrainerState, control: TrainerControl) -> None:
        """The epoch cut short by the stop ends without a second save (or evaluation) of
        the step already saved."""
        if self.stop is not None and self.stop.step == state.global_step:
            control.should_save = control.should_evaluate = False

    def jit_hook(self, where: str, state: TrainerState, control: TrainerControl) -> None:
        """In ``"jit"`` mode, after the Trainer's JIT callback ran its ``where`` hook: the
        first hook after the signal finishes the upload in flight (the JIT checkpoint may
        be written under that upload's ``checkpoint-N`` name, over its files); a JIT save
        made before a step boundary is named at WARNING, since a resume from it may not
        repeat an uninterrupted run."""
        if self.mode != "jit" or not requested():
            return
        if not self._jit_settled:
            self._jit_settled = True
            self.job.settle(within_grace(None))
        if self._jit_seen or not control.should_training_stop or where not in _MID_STEP:
            return
        self._jit_seen = True
        if state.is_world_process_zero:
            at, exact = _MID_STEP[where]
            log.warning(
                "SIGTERM: transformers wrote its just-in-time checkpoint-%d %s: %s. Let "
                "taskpoint save at the step boundary instead: save_on_preemption=True or "
                "TASKPOINT_SAVE_ON_PREEMPTION=1",
                state.global_step, at.format(step=state.global_step + 1), exact,
            )

    def end_bound(self) -> float | None:
        """Seconds ``on_train_end`` may wait for the upload (``None``: no limit)."""
        if self.stop is not None:
            return self.stop.budget()
        return within_grace(None) if self.mode == "jit" else None

    def finish(self, state: TrainerState, committed: bool, error: BaseException | None = None) -> None:
        """End of training: leave the deferral; after a preemption stop (:attr:`stop`), say
        what became of its save and raise (every rank; outside a task world process zero
        records the end as preempted in the mirror's checkpoint).

        Raises:
            taskpoint.Preempted: training stopped for a preemption signal.
        """
        self._ended = True
        self.close()
        stop = self.stop
        if stop is None:
            return
        if not stop.saving:
            outcome = f"no save ({stop.reason})"
        elif committed and error is None:
            outcome = f"checkpoint-{stop.step} committed"
        else:
            why = f"its upload failed: {error}" if error is not None else "its upload still runs"
            outcome = f"checkpoint-{stop.step} missed ({why})"
        self._stop.end(
            f"received {stop.signal}; training stopped at step {stop.step}: {outcome}",
            step=stop.step, leader=state.is_world_process_zero, checkpoint=self.job.checkpoint,
            cause=error,
        )

    def failed(self, exc: BaseException, step: int | None) -> None:
        """Training ended by ``exc``: wait for this rank's upload in flight (no
        collective), bounded by the preemption deadline or ``wait_timeout``."""
        if self._ended:
            return
        self._ended = True
        try:
            self.job.settle_failed(exc, within_grace(self.wait_timeout), step)
        finally:
            self.close()

    def close(self) -> None:
        """Leave the deferral and drop the vote's group (local calls)."""
        self._stack.close()
        self._stop.close()

"""``TaskpointTrainerCallback``: mirror the Trainer's ``output_dir`` after every save. How
each save's figures reach the logging callbacks: :mod:`taskpoint_hf._hooks`; SIGTERM and
exceptions: :mod:`taskpoint_hf._preemption`."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import taskpoint
from taskpoint import CheckpointLike
from taskpoint.integration import (
    all_gather_object,
    check_checkpoint_like,
    check_timeout,
    check_wait,
)
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from taskpoint_hf import _hooks
from taskpoint_hf._failure_save import FailureSave
from taskpoint_hf._interval import SaveEvery, TimedSaves, check_save_every
from taskpoint_hf._mirror import OutputMirror, marks, written_dir
from taskpoint_hf._preemption import Preemption
from taskpoint_hf.resume import _step

__all__ = ["TaskpointTrainerCallback"]

log = logging.getLogger(__name__)


class TaskpointTrainerCallback(TrainerCallback):
    """Save the Trainer's ``output_dir`` to a taskpoint checkpoint after each ``checkpoint-N``.

    The save happens in ``on_save``, which the Trainer (and TRL's trainers built on it)
    calls once ``checkpoint-N`` is written and the ``save_total_limit`` rotation has run, so
    the store holds exactly the checkpoints the Trainer kept (also after its end-of-training
    rotation or a just-in-time checkpoint written under an existing name). Full models and
    PEFT adapters alike; the guide (``docs/frameworks/hf.md``) tells the whole story:

    - with several processes and a :class:`taskpoint.Checkpoint`, every node's files reach
      one checkpoint (:class:`taskpoint.checkpoint.job_mirror.JobMirror`); with another
      system's checkpoint world process zero saves alone;
    - uploads run in the background, one at a time; a failure raises at the next
      ``on_save`` or at ``on_train_end``, which waits for the upload (so does an exception
      out of ``train()``, within ``preempt_timeout``); each save's figures
      (``taskpoint/blocked_s``, ``upload_s``, ``uploaded_bytes``, ``stored_bytes``,
      ``saves``) reach every callback's ``on_log``, never ``state.log_history``;
    - SIGTERM becomes a save (inside a task, ``save_on_preemption``, or with
      ``enable_jit_checkpoint``): every rank stops at one step boundary, the Trainer writes
      ``checkpoint-N`` there when it fits in ``TASKPOINT_GRACE_PERIOD``, and
      ``trainer.train()`` raises :class:`taskpoint.Preempted` (see
      :mod:`taskpoint_hf._preemption`);
    - with ``save_on_exception``, an exception out of ``train()`` that left the model as
      the last completed step left it (a failure in the next step's forward pass, an
      evaluation, a callback) has the Trainer write that step's ``checkpoint-N``, uploaded
      before the exception leaves ``train()`` (see :mod:`taskpoint_hf._failure_save`);
    - ``save_every_s`` asks the Trainer to save (``control.should_save``) once that many
      seconds of training passed since the last save, beside ``save_strategy`` (not with
      ``"best"``); ``"auto"`` chooses the interval with :class:`taskpoint.SaveInterval`
      (:attr:`save_interval` tells what and why).

    Resume with :func:`~taskpoint_hf.restore_last_checkpoint`.

    Args:
        checkpoint: where to save (a :class:`taskpoint.Checkpoint`, or any
            :class:`~taskpoint.CheckpointLike` such as Flyte's checkpoint).
        output_dir: the Trainer's ``output_dir``; ``None`` takes ``args.output_dir`` when
            training begins.
        blocking: upload inside ``on_save``, every rank waiting for the commit. ``None``
            (the default): in the background for a :class:`taskpoint.Checkpoint`, blocking
            for another system's checkpoint (Flyte's), whose attempt may hand its checkpoint
            on before a background upload lands.
        preempt_timeout: seconds the end of an attempt waits for the upload in flight when
            no preemption deadline bounds it (an exception, a SIGTERM not turned into a
            save); ``None`` waits as long as it takes.
        timeout: in a distributed job, seconds a rank waits for the others at each step of
            a save (the uploads included) and at a preemption vote.
        save_on_preemption: whether SIGTERM becomes a save; ``None`` decides with
            :func:`taskpoint.preemption.save_on_preemption` (inside a task, or when the
            Trainer has ``enable_jit_checkpoint``).
        save_every_s: save also once this many seconds of training passed since the last
            save; ``"auto"``, or a :class:`taskpoint.SaveInterval` of your own (other
            bounds, another clock); ``None`` (the default): by ``save_strategy`` only.
        save_on_exception: when an exception ends ``train()``, save the last completed
            step if nothing was written since it ended (one process only: not under
            ``torch.distributed``); a warning says why when it cannot.

    Raises:
        TypeError: ``checkpoint`` lacks the checkpoint methods, ``output_dir`` is not a
            path, or ``save_on_exception`` not a bool.
        ValueError: ``preempt_timeout`` is negative, ``timeout`` not positive,
            ``save_every_s`` neither positive seconds, ``"auto"`` nor a
            :class:`taskpoint.SaveInterval`; when training begins, ``TASKPOINT_MTBF_PRIOR_S``
            is unusable.
    """

    def __init__(
        self,
        checkpoint: CheckpointLike,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        blocking: bool | None = None,
        preempt_timeout: float | None = 60.0,
        timeout: float = 600.0,
        save_on_preemption: bool | None = None,
        save_every_s: SaveEvery | None = None,
        save_on_exception: bool = False,
    ) -> None:
        self._checkpoint = check_checkpoint_like(checkpoint, "TaskpointTrainerCallback")
        if not isinstance(save_on_exception, bool):
            raise TypeError(
                f"save_on_exception must be True or False; got {save_on_exception!r}"
            )
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(
                "output_dir must be a str or os.PathLike naming the Trainer's output_dir, or "
                f"None to use args.output_dir; got {type(output_dir).__name__}"
            )
        preempt_timeout = check_wait(preempt_timeout, "preempt_timeout")
        self._timed = TimedSaves(check_save_every(save_every_s))
        self._output_dir = Path(os.fspath(output_dir)) if output_dir is not None else None
        self._saves = OutputMirror(checkpoint, blocking=blocking, timeout=check_timeout(timeout))
        self._logs = _hooks.LogHook(self)  # the handler whose on_log adds the figures
        self._preemption = Preemption(save_on_preemption, self._saves, wait_timeout=preempt_timeout)
        self._step: int | None = None
        self._failure = FailureSave() if save_on_exception else None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._checkpoint!r}, output_dir={self._output_dir!r}, "
            f"blocking={self._saves.uploads.blocking})"
        )

    @property
    def save_interval(self) -> taskpoint.IntervalChoice | None:
        """The interval of the saves by time (``save_every_s``) in force and, for ``"auto"``,
        what it was chosen from; ``None`` without one, or before training begins. Local to
        this rank: world process zero's decides."""
        return self._timed.choice

    @property
    def output_dir(self) -> Path | None:
        """The directory mirrored (``None`` until training begins when none was given)."""
        return self._output_dir

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the upload in flight (if any) has committed: ``True`` once no upload
        runs, ``False`` if ``timeout`` seconds (``None``: no limit) ran out first.

        Raises:
            taskpoint.CheckpointError: the upload failed.
        """
        return self._saves.uploads.wait(timeout)

    def _folder(self, args: TrainingArguments) -> Path:
        if self._output_dir is None:
            self._output_dir = written_dir(args.output_dir)
        return self._output_dir

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Wrap the Trainer's ``train`` so that an exception out of it waits for the upload
        in flight first."""
        _hooks.guard_train(self, self._training_failed)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Check that the Trainer writes inside the mirrored directory, then prepare the
        saves (in a distributed job, with every rank) and the SIGTERM handling.

        Raises:
            ValueError: ``args.output_dir`` is neither the callback's ``output_dir`` nor
                inside it, so its checkpoints would never be saved; or
                ``TASKPOINT_SAVE_ON_PREEMPTION`` / ``TASKPOINT_GRACE_PERIOD`` are unusable.
        """
        folder = self._folder(args)
        written = Path(os.path.abspath(written_dir(args.output_dir)))
        mirrored = Path(os.path.abspath(folder))
        if written != mirrored and mirrored not in written.parents:
            raise ValueError(
                f"TaskpointTrainerCallback mirrors {str(folder)!r} but the Trainer writes its "
                f"checkpoints to output_dir={str(args.output_dir)!r}; pass the same "
                "directory (or output_dir=None to follow the TrainingArguments)"
            )
        self._report(state)
        handler = self._logs.hook()
        guarded = _hooks.guard_train(self, self._training_failed)
        self._saves.start(folder)
        self._timed.start(self._checkpoint)
        self._preemption.begin(handler, state, guarded=guarded)
        if state.is_world_process_zero and args.save_total_limit is None and args.save_strategy != "no":
            log.warning(
                "save_total_limit is unset: every checkpoint-N in %s is kept and each save "
                "uploads all of them; set save_total_limit (2 is plenty for resuming)",
                folder,
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Notice a just-in-time checkpoint the Trainer wrote here (before the step)."""
        self._preemption.jit_hook("on_step_begin", state, control)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Notice a just-in-time checkpoint the Trainer wrote here (mid-step)."""
        self._preemption.jit_hook("on_pre_optimizer_step", state, control)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Save ``output_dir`` once every rank has finished writing ``checkpoint-N``.

        Raises:
            taskpoint.CheckpointError: the previous background upload failed (on world
                process zero; the store keeps the checkpoint before it).
        """
        began = time.monotonic()
        if self._failure is not None:
            self._failure.saved(state.global_step)
        self._saves.written(state.global_step)
        self._saves.save(
            self._folder(args), step=state.global_step, leader=state.is_world_process_zero
        )
        background = state.is_world_process_zero and self._saves.background
        self._timed.saved_since(began, background=background)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Report the step; note the state for a save at an exception; unshare
        ``checkpoint-N`` if the Trainer is about to write it again; after a SIGTERM, stop
        here with every rank (and save, in time)."""
        self._report(state)
        if self._failure is not None:
            self._failure.note(state, kwargs.get("model"), kwargs.get("optimizer"))
        self._preemption.jit_hook("on_step_end", state, control)
        self._preemption.at_step_end(args, state, control, self._saves.estimate)
        self._timed.at_step_end(control)
        self._next(args, state, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unshare ``checkpoint-N`` if the Trainer is about to write it again."""
        self._preemption.at_epoch_end(state, control)
        self._next(args, state, control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unshare ``checkpoint-N`` if the Trainer is about to write it again
        (``save_strategy="best"`` decides to save only after evaluating)."""
        self._timed.before_save(control)
        saving = args.save_strategy == "best"
        self._saves.unshare_next(written_dir(args.output_dir), state.global_step, saving=saving)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the figures of the saves committed since the last log to ``logs``, where the
        Trainer's ``on_log`` could not be hooked (otherwise the hook has added them)."""
        self._timed.before_save(control)
        if logs is not None and self._logs.hooked() is None:
            self._add_figures(state, control, logs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Upload what no ``on_save`` announced (a just-in-time checkpoint, the Trainer's
        last rotation), wait for the upload in flight (after a SIGTERM, within the grace
        period), and log the figures of a save after the Trainer's last logs with one more
        ``on_log``.

        Raises:
            taskpoint.CheckpointError: an upload failed (on world process zero).
            taskpoint.Preempted: training stopped for a preemption signal.
        """
        folder = self._folder(args)
        found = marks(folder) if state.is_world_process_zero else {}
        behind = state.is_world_process_zero and found != self._saves.mirrored
        if any(all_gather_object(behind)):
            step = max((_step(Path(n)) for n in found), default=None)
            self._saves.save(folder, step=step, leader=state.is_world_process_zero)
        committed, error = True, None
        try:
            committed = self._saves.finish(
                self._preemption.end_bound(), leader=state.is_world_process_zero
            )
        except Exception as exc:
            if self._preemption.stop is None:
                self._saves.release()  # as after a train that ended well
                self._preemption.finish(state, True)
                raise
            error = exc
        if self._preemption.stop is not None and self._saves.nodes is None:
            # world process zero uploads alone: every rank learns whether it committed, and
            # none ends (torchrun then stops the others) before it is known
            committed = all(all_gather_object(committed and error is None))
        if state.is_world_process_zero:
            metrics = self._with_interval(self._saves.take_metrics())
            handler = self._logs.hooked()
            if metrics and handler is not None:  # a save after the Trainer's last log
                handler.call_event(  # type: ignore[no-untyped-call]
                    "on_log", args, state, control, logs=metrics
                )
            elif metrics:
                log.info("taskpoint figures at the end of training: %s", metrics)
        self._saves.release()  # training is over; the checkpoint stays open for a later train()
        self._preemption.finish(state, committed, error)

    def _add_figures(
        self, state: TrainerState, control: TrainerControl, logs: dict[str, float]
    ) -> None:
        """Add the figures of the saves committed since the last log to ``logs``."""
        if state.is_world_process_zero:
            stopping = self._preemption.stop is not None
            logs.update(self._with_interval(self._saves.figures(state, control, stopping)))

    def _with_interval(self, figures: dict[str, float]) -> dict[str, float]:
        """``figures`` with the save interval's choice and its inputs beside the saves'
        cost, when there are figures and the interval is by time."""
        interval = self._timed.interval
        if figures and interval is not None:
            figures.update(interval.choice.metrics())
        return figures

    def _next(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
        """The Trainer may write ``checkpoint-N`` next: unshare it, note when."""
        self._timed.asked(control)
        saving = control.should_save
        self._saves.unshare_next(written_dir(args.output_dir), state.global_step, saving=saving)
        self._saves.asked(control)

    def _report(self, state: TrainerState) -> None:
        self._step = state.global_step
        taskpoint.report_step(state.global_step)

    def _training_failed(self, exc: BaseException, trainer: Any) -> None:
        """``exc`` is leaving ``trainer.train()``: the save at the exception, if asked for
        and possible, then wait for this rank's uploads (bounded)."""
        if self._failure is not None and self._output_dir is not None:
            written = written_dir(trainer.args.output_dir)
            step = self._failure.at_failure(
                exc, trainer, lambda at: self._saves.unshare_next(written, at, saving=True)
            )
            if step is not None:
                try:  # as the Trainer announces its own saves (a subclass may add to it)
                    self.on_save(trainer.args, trainer.state, trainer.control, model=trainer.model)
                except Exception as error:
                    log.warning("the upload of checkpoint-%d at the failure failed: %s: %s",
                                step, type(error).__name__, error)
                else:
                    log.warning("wrote checkpoint-%d at the failure (%s): the retry resumes "
                                "there", step, type(exc).__name__)
        self._preemption.failed(exc, self._step)

"""``TaskpointTrainerCallback``: mirror the Trainer's ``output_dir`` after every save.

Example::

    import taskpoint
    from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint

    ckpt = taskpoint.ctx().checkpoint
    args = TrainingArguments(output_dir="out", save_strategy="epoch", save_total_limit=2)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[TaskpointTrainerCallback(ckpt, args.output_dir)])
    trainer.train(resume_from_checkpoint=restore_last_checkpoint(ckpt, args))

Each upload runs in the background: training goes on while the store is written, and the
cost of each save is logged with the Trainer's own metrics (``taskpoint/blocked_s``,
``taskpoint/upload_s``, ``taskpoint/uploaded_bytes``, ``taskpoint/stored_bytes``) to every
logging callback, ``report_to`` integrations included, but not to ``state.log_history``.

How the figures get there: at training start the callback hooks the ``on_log`` of the
Trainer's ``CallbackHandler`` calling it, which the Trainer calls once it has recorded its
own copy of the logs; the hook adds the figures before any callback sees them. The
Trainer's last logs (after the last save) wait for that save's upload, so its figures come
with them; a save later still (a just-in-time checkpoint, or the end-of-training rotation)
is logged by one more ``on_log`` at ``on_train_end``. Called by anything but a
``CallbackHandler``, the callback adds them to the ``logs`` its own ``on_log`` gets.

SIGTERM and exceptions: see :mod:`taskpoint_hf._preemption`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import taskpoint
from taskpoint import CheckpointLike
from taskpoint.integration import all_gather_object, check_timeout
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from taskpoint_hf import _hooks
from taskpoint_hf._interval import SaveEvery, TimedSaves, check_save_every
from taskpoint_hf._mirror import OutputMirror, marks, written_dir
from taskpoint_hf._preemption import Preemption
from taskpoint_hf.resume import _step

__all__ = ["TaskpointTrainerCallback"]

log = logging.getLogger(__name__)


class TaskpointTrainerCallback(TrainerCallback):
    """Save the Trainer's ``output_dir`` to a taskpoint checkpoint after each ``checkpoint-N``.

    The save happens in ``on_save``, which the Trainer (and TRL's trainers built on it,
    such as ``SFTTrainer``) calls once ``checkpoint-N`` is completely written and the
    ``save_total_limit`` rotation has deleted old ones, so the store holds exactly the
    checkpoints the Trainer kept. Works with ``save_strategy`` ``"steps"`` and ``"epoch"``,
    full models and PEFT adapters alike.

    In a distributed job (a ``torch.distributed`` process group of several processes, with
    a :class:`taskpoint.Checkpoint`) every node's files reach one checkpoint, with or
    without a shared disk and whatever ``save_on_each_node`` says: at training start the
    ranks find out which of them share ``output_dir``; at each save, once every rank has
    written its files, the first rank of each disk stages that disk's files (a later disk
    only what the first lacks), then every rank commits its part with
    :meth:`taskpoint.Checkpoint.save_part_sync` over a gloo group of its own. A failure on
    any rank fails the save on every rank, and a rank that never arrives fails the others
    after ``timeout`` seconds. With another system's checkpoint, world process zero saves
    its own ``output_dir`` alone.

    By default the upload runs in the background: a snapshot of ``output_dir`` (hard links
    where the disk allows) is uploaded while every rank trains on. At most one upload is in
    flight: a save while the previous upload still runs waits for it first. An upload that
    failed raises its error at the next ``on_save`` or at ``on_train_end``, which also waits
    for the upload in flight. Training that ends by an exception waits for the upload in
    flight too, before the exception leaves ``trainer.train()`` (the callback wraps it when
    the Trainer is built with it), for up to ``preempt_timeout`` seconds.

    SIGTERM becomes a save inside a taskpoint task, with ``save_on_preemption=True`` or
    ``TASKPOINT_SAVE_ON_PREEMPTION=1``, and when the Trainer has ``enable_jit_checkpoint``:
    every rank stops at the same step boundary, the Trainer writes ``checkpoint-N`` there
    (the one it resumes from exactly), its upload is waited for within the grace period
    (``TASKPOINT_GRACE_PERIOD``), and ``trainer.train()`` raises
    :class:`taskpoint.Preempted`. A save that would not fit in the time left is skipped,
    loudly; the store keeps the checkpoint before. Otherwise a SIGTERM inside a task
    context waits for the upload in flight (``preempt_timeout``) and ends the attempt. The
    step reached is reported to taskpoint (:func:`taskpoint.report_step`) at every step.

    Each save's cost reaches every callback's ``on_log`` (``taskpoint/blocked_s``,
    ``taskpoint/upload_s``, ``taskpoint/uploaded_bytes``, ``taskpoint/stored_bytes``,
    ``taskpoint/saves``) with the next logs after its upload committed, never
    ``state.log_history``. The store ends holding what the Trainer kept, also after the
    Trainer's end-of-training rotation or a just-in-time checkpoint written under an
    existing name. A resumed run writes an existing ``checkpoint-N`` again, in place: files
    an upload's snapshot still shares get copies of their own first.

    Saves by time: with ``save_every_s`` the callback also asks the Trainer to save
    (``control.should_save`` at a step end) once that many seconds of training have passed
    since the last save, whatever made it, beside ``save_strategy``/``save_steps``; the
    Trainer writes ``checkpoint-N`` as for any save (``save_total_limit`` applies), so it
    works under ``save_strategy="no"`` too, but not with ``"best"``, whose own decision
    replaces every other one after evaluating. ``save_every_s="auto"`` chooses the interval
    with :class:`taskpoint.SaveInterval`: Young and Daly's ``sqrt(2 x cost x mean time
    between failures)``, from what a save costs training here (the time from the step's end
    to the end of ``on_save``, plus what the background upload takes from the steps beside
    it) and the run's failures in the store's attempt records (until there are some, a prior:
    ``TASKPOINT_MTBF_PRIOR_S``, four hours by default), within 2% of training time and an
    hour at most. The first save then comes at the first step, to measure its cost. For
    other bounds pass ``taskpoint.SaveInterval.for_checkpoint(checkpoint, "auto",
    mtbf_prior_s=..., max_overhead=..., max_interval_s=...)`` itself. In a distributed job
    world process zero's clock decides and every rank saves at the same step (one broadcast
    per step). With a preemption warning (SIGTERM turned into a save) the interval only has
    to cover the failures that come without one. :attr:`save_interval` tells what was chosen
    and why; each change is logged at INFO and recorded in the attempt's records
    (``taskpoint show``).

    Resume with :func:`~taskpoint_hf.restore_last_checkpoint`.

    Args:
        checkpoint: where to save (a :class:`taskpoint.Checkpoint`, or any
            :class:`~taskpoint.CheckpointLike` such as Flyte's checkpoint).
        output_dir: the Trainer's ``output_dir``; ``None`` takes ``args.output_dir`` when
            training begins.
        blocking: upload inside ``on_save``, every rank waiting until it has committed.
            ``None`` (the default): in the background for a :class:`taskpoint.Checkpoint`,
            blocking for another system's checkpoint (Flyte's), whose attempt may end and
            hand its checkpoint on before a background upload lands.
        preempt_timeout: how many seconds the end of an attempt waits for the upload in
            flight when no preemption deadline bounds it (an exception out of training, a
            SIGTERM that is not turned into a save); ``None`` waits as long as it takes.
        timeout: in a distributed job, how many seconds a rank waits for the others at
            each step of a save (the uploads included) and at a preemption vote.
        save_on_preemption: whether SIGTERM becomes a save; ``None`` decides with
            :func:`taskpoint.preemption.save_on_preemption` (inside a task, or when the
            Trainer has ``enable_jit_checkpoint``).
        save_every_s: save also once this many seconds of training have passed since the
            last save; ``"auto"`` to choose the interval from the save's cost and the run's
            failures; a :class:`taskpoint.SaveInterval` of your own (other bounds, another
            clock); ``None`` (the default): by ``save_strategy`` only.

    Raises:
        TypeError: ``checkpoint`` lacks the checkpoint methods, or ``output_dir`` is not a
            path.
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
    ) -> None:
        if not isinstance(checkpoint, CheckpointLike):
            raise TypeError(
                "checkpoint must be a taskpoint.Checkpoint or another CheckpointLike (with "
                f"save/save_sync/load/load_sync); got {type(checkpoint).__name__}"
            )
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(
                "output_dir must be a str or os.PathLike naming the Trainer's output_dir, or "
                f"None to use args.output_dir; got {type(output_dir).__name__}"
            )
        if preempt_timeout is not None and not preempt_timeout >= 0:
            raise ValueError(
                f"preempt_timeout must be a number of seconds >= 0 or None; got {preempt_timeout!r}"
            )
        self._timed = TimedSaves(check_save_every(save_every_s))
        self._checkpoint = checkpoint
        self._output_dir = Path(os.fspath(output_dir)) if output_dir is not None else None
        self._saves = OutputMirror(checkpoint, blocking=blocking, timeout=check_timeout(timeout))
        self._logs = _hooks.LogHook(self)  # the handler whose on_log adds the figures
        self._preempt_timeout = preempt_timeout
        self._preemption = Preemption(
            save_on_preemption, wait_timeout=preempt_timeout, timeout=self._saves.timeout
        )
        self._step: int | None = None

    def __repr__(self) -> str:
        return (
            f"TaskpointTrainerCallback({self._checkpoint!r}, output_dir={self._output_dir!r}, "
            f"blocking={self._saves.uploads.blocking})"
        )

    @property
    def save_interval(self) -> taskpoint.IntervalChoice | None:
        """The interval of the saves by time (``save_every_s``) now in force, and for
        ``"auto"`` what it was chosen from (its ``metrics()`` are the ``taskpoint/*``
        figures logged beside each save). ``None`` without ``save_every_s``, or before
        training begins. Local to this rank: world process zero's decides."""
        interval = self._timed.interval
        return None if interval is None else interval.choice

    @property
    def output_dir(self) -> Path | None:
        """The directory mirrored (``None`` until training begins when none was given)."""
        return self._output_dir

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the upload in flight (if any) has committed.

        Args:
            timeout: give up after this many seconds (``None``: no limit).

        Returns:
            ``True`` once no upload runs; ``False`` if ``timeout`` ran out first.

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
        trainer = _hooks.calling_trainer(self)
        if trainer is not None:
            _hooks.guard_train(trainer, self._training_failed)

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
        trainer = _hooks.calling_trainer(self)
        guarded = trainer is not None and _hooks.guard_train(trainer, self._training_failed)
        self._saves.start(folder)
        self._timed.start(self._checkpoint)
        self._preemption.begin(handler, state, self._on_preempt, guarded=guarded)
        if (
            state.is_world_process_zero
            and args.save_total_limit is None
            and str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
        ):
            log.warning(
                "save_total_limit is unset: every checkpoint-N in %s is kept and each save "
                "uploads all of them; set save_total_limit (2 is plenty for resuming)",
                folder,
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Notice a just-in-time checkpoint the Trainer wrote here (before the step)."""
        self._preemption.jit_hook("on_step_begin", state, control, self._saves.settle)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Notice a just-in-time checkpoint the Trainer wrote here (mid-step)."""
        self._preemption.jit_hook("on_pre_optimizer_step", state, control, self._saves.settle)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Save ``output_dir`` once every rank has finished writing ``checkpoint-N``.

        Raises:
            taskpoint.CheckpointError: the previous background upload failed (on world
                process zero; the store keeps the checkpoint before it).
        """
        began = time.monotonic()
        self._saves.written(state.global_step)
        self._saves.save(self._folder(args), state, state.global_step)
        # One writer's background upload goes on until its commit, which the interval hears of.
        background = (
            state.is_world_process_zero and self._saves.nodes is None
            and not self._saves.uploads.blocking
        )
        self._timed.saved(began, background=background)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Report the step; unshare ``checkpoint-N`` if the Trainer is about to write it
        again; after a SIGTERM, stop here with every rank (and save, in time)."""
        self._report(state)
        self._preemption.jit_hook("on_step_end", state, control, self._saves.settle)
        self._preemption.at_step_end(
            args, state, control, settle=self._saves.settle, estimate=self._saves.estimate,
        )
        self._timed.at_step_end(control)
        self._next(args, state, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unshare ``checkpoint-N`` if the Trainer is about to write it again."""
        self._preemption.at_epoch_end(state, control)
        self._timed.asked(control)
        self._next(args, state, control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unshare ``checkpoint-N`` if the Trainer is about to write it again
        (``save_strategy="best"`` decides to save only after evaluating)."""
        best = str(getattr(args.save_strategy, "value", args.save_strategy)) == "best"
        self._timed.before_save(control)
        self._saves.unshare_next(written_dir(args.output_dir), state.global_step, saving=best)

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
        last rotation), and wait for the upload in flight (after a SIGTERM, within the
        grace period).

        Raises:
            taskpoint.CheckpointError: an upload failed (on world process zero).
            taskpoint.Preempted: training stopped for a preemption signal.
        """
        folder = self._folder(args)
        found = marks(folder) if state.is_world_process_zero else {}
        behind = state.is_world_process_zero and found != self._saves.mirrored
        if any(all_gather_object(behind)):
            self._saves.save(folder, state, max((_step(Path(n)) for n in found), default=None))
        committed, error = True, None
        try:
            committed = self._saves.finish(
                self._preemption.end_bound(), leader=state.is_world_process_zero
            )
        except Exception as exc:
            if not self._preemption.stopping:
                self._preemption.finish(state, True)
                raise
            error = exc
        if self._preemption.stopping and self._saves.nodes is None:
            # world process zero uploads alone: every rank learns whether it committed, and
            # none ends (torchrun then stops the others) before it is known
            committed = all(all_gather_object(committed and error is None))
        if state.is_world_process_zero:
            metrics = self._saves.take_metrics()
            handler = self._logs.hooked()
            if metrics and handler is not None:  # a save after the Trainer's last log
                handler.call_event(  # type: ignore[no-untyped-call]
                    "on_log", args, state, control, logs=metrics
                )
            elif metrics:
                log.info("taskpoint figures at the end of training: %s", metrics)
        self._preemption.finish(state, committed, error, self._checkpoint)

    def _add_figures(
        self, state: TrainerState, control: TrainerControl, logs: dict[str, float]
    ) -> None:
        """Add the figures of the saves committed since the last log to ``logs``."""
        if state.is_world_process_zero:
            figures = self._saves.figures(state, control, self._preemption.stopping)
            interval = self._timed.interval
            if figures and interval is not None:  # the interval now, beside the save's cost
                figures.update(interval.choice.metrics())
            logs.update(figures)

    def _next(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
        """The Trainer may write ``checkpoint-N`` next: unshare it, note when."""
        saving = control.should_save
        self._saves.unshare_next(written_dir(args.output_dir), state.global_step, saving=saving)
        self._saves.asked(control)

    def _report(self, state: TrainerState) -> None:
        self._step = state.global_step
        taskpoint.report_step(state.global_step)

    def _training_failed(self, exc: BaseException) -> None:
        self._preemption.failed(exc, self._saves.settle, self._step)

    def _on_preempt(self) -> None:
        """SIGTERM not turned into a save, inside a task context: wait for the upload in
        flight (``preempt_timeout``, and never past the grace period), then the attempt
        ends."""
        self._saves.wait_on_signal(self._preemption.signal_bound(self._preempt_timeout))

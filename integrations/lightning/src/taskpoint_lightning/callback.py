"""``TaskpointModelCheckpoint``: a ``ModelCheckpoint`` that mirrors its folder to the store
(:mod:`taskpoint_lightning._mirroring`), turns SIGTERM into a save at a step boundary
(:mod:`taskpoint_lightning._preemption`), saves by training time
(:mod:`taskpoint_lightning._interval`) and keeps the random state
(:mod:`taskpoint_lightning._rng`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import taskpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.seed import _set_rng_states
from lightning.pytorch.callbacks import ModelCheckpoint
from taskpoint import CheckpointLike
from taskpoint.integration import (
    JobMirror,
    check_checkpoint_like,
    check_timeout,
    check_wait,
    wait_on_preemption,
    within_grace,
)

from taskpoint_lightning._interval import TimedSaves, check_time_interval
from taskpoint_lightning._mirroring import Fit, Mirroring
from taskpoint_lightning._on_exception import ExceptionFiles
from taskpoint_lightning._preemption import Preemption
from taskpoint_lightning._rng import (
    RNG_STATE_KEY,
    load_from_checkpoint,
    stash_in_checkpoint,
)
from taskpoint_lightning.resume import filled_by_resume

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RNG_STATE_KEY", "TaskpointModelCheckpoint"]

log = logging.getLogger(__name__)


def _at_step_boundary(trainer: pl.Trainer) -> bool:
    """Whether the batch just done applied its gradients (not inside an accumulation)."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


class _TaskpointMirror(Mirroring):
    """The adapter's behaviour, mixed into ``lightning.pytorch``'s and the standalone
    ``pytorch_lightning``'s ``ModelCheckpoint``."""

    def __init__(
        self,
        checkpoint: CheckpointLike,
        *args: Any,
        blocking: bool | None = None,
        preempt_timeout: float | None = 60.0,
        save_on_preemption: bool | None = None,
        timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        self._taskpoint = check_checkpoint_like(checkpoint, type(self).__name__)
        try:
            self._timeout = check_timeout(timeout)
            preempt_timeout = check_wait(preempt_timeout, "preempt_timeout")
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        timed = check_time_interval(
            kwargs.pop("train_time_interval", None), type(self).__name__, kwargs
        )
        if timed is not None:
            # Lightning's triggers as for a time interval (no saves at epoch ends unless
            # asked), its own time check then switched off: this callback's runs instead.
            kwargs["train_time_interval"] = timedelta(seconds=1)
        self._timed = TimedSaves(timed)
        super().__init__(*args, **kwargs)
        self._train_time_interval: timedelta | None = None
        self._blocking = blocking
        self._preempt_timeout = preempt_timeout
        self._save_on_preemption = save_on_preemption
        self._unmirrored = False
        self._rng_for_train_start: dict[str, Any] | None = None
        # This process's machinery, made when first needed and never copied (see
        # __getstate__): the upload thread and the fit's.
        self._job_mirror: JobMirror | None = None
        self._fit: Fit | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What pickling and ``copy.deepcopy`` carry (``ddp_spawn`` pickles the callbacks):
        settings, Lightning's state and the checkpoint (as its configuration), not this
        process's machinery; the mirror in flight is waited for first.

        Raises:
            taskpoint.CheckpointError: the mirror in flight failed.
        """
        self.wait()
        state = dict(self.__dict__)
        state.update(_job_mirror=None, _fit=None)
        return state

    @property
    def checkpoint(self) -> CheckpointLike:
        """The store checkpoint that ``dirpath`` is mirrored to."""
        return self._taskpoint

    @property
    def save_interval(self) -> taskpoint.IntervalChoice | None:
        """The interval of the saves by time (``train_time_interval``) in force and, for
        ``"auto"``, what it was chosen from; ``None`` without one, or before setup. Local
        to this rank: global rank zero's decides."""
        return self._timed.choice

    @property
    def state_key(self) -> str:
        """``ModelCheckpoint``'s key for this callback's state, naming
        ``train_time_interval`` as given (``"auto"`` stays ``"auto"`` whatever it chooses)."""
        return self._generate_state_key(  # type: ignore[attr-defined,no-any-return]
            monitor=self.monitor,  # type: ignore[attr-defined]
            mode=self.mode,  # type: ignore[attr-defined]
            every_n_train_steps=self._every_n_train_steps,  # type: ignore[attr-defined]
            every_n_epochs=self._every_n_epochs,  # type: ignore[attr-defined]
            train_time_interval=self._timed.key(),
        )

    # -- setup ------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():
            if self.dirpath is not None and filled_by_resume(self.dirpath):
                # resume_ckpt_path(..., dirpath=...) filled the folder on purpose.
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* not empty")
            super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if not _is_local_file_protocol(self.dirpath):
            raise ValueError(
                f"{type(self).__name__} mirrors a local folder to the store, but "
                f"dirpath={self.dirpath!r} is remote; give it a local dirpath (the store "
                "holds the durable copy)"
            )
        # SIGTERM outside training waits for the mirror in flight (inside, with
        # save_on_preemption, the stop does)
        wait_on_preemption(self._job, self._preempt_timeout, leader=trainer.is_global_zero)
        self._job.join(Path(self.dirpath))
        if stage == "fit":
            self._timed.start(self._taskpoint)
            if self._fit is not None:
                self._fit.stop.sequence.close()
            files = ExceptionFiles.find(trainer, self, os.fspath(self.dirpath))
            stop = Preemption.start(trainer, self._save_on_preemption, self._timeout)
            self._fit = Fit(stop, files)

    # -- the hooks that save: mirror once each has written and pruned --------------------

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        taskpoint.report_step(trainer.global_step)
        with self._timed.measured(trainer, self._save_token):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]
            if _at_step_boundary(trainer) and self._timed.due_on(trainer):
                self._save_on_time(trainer)
            self._mirror(trainer)
        fit = self._fit
        if fit is not None and _at_step_boundary(trainer) and fit.stop.sequence.requested():
            where = f"after batch {batch_idx} of epoch {trainer.current_epoch}"
            self._preemption_stop(trainer, where=where)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._timed.measured(trainer, self._save_token):
            super().on_train_epoch_end(trainer, pl_module)  # type: ignore[misc]
            self._mirror(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._timed.measured(trainer, self._save_token):
            super().on_validation_end(trainer, pl_module)  # type: ignore[misc]
            self._mirror(trainer)

    # -- saves by training time (train_time_interval, see _interval) ---------------------

    def _save_on_time(self, trainer: pl.Trainer) -> None:
        """The timed save every rank agreed on, as ``ModelCheckpoint`` saves at a step:
        top-k and ``last``; none twice at one step, none outside fitting; deferred to the
        validation's end while the monitored metric is not logged yet."""
        if self._should_skip_saving_checkpoint(trainer):  # type: ignore[attr-defined]
            return
        candidates = self._monitor_candidates(trainer)  # type: ignore[attr-defined]
        if self.monitor is not None and self.monitor not in candidates:  # type: ignore[attr-defined]
            self._defer_save_until_validation = True
            return
        self._save_topk_checkpoint(trainer, candidates)  # type: ignore[attr-defined]
        self._save_last_checkpoint(trainer, candidates)

    def _save_token(self) -> tuple[object, ...]:
        """Changes with every save Lightning makes and every mirror started."""
        return (
            self._last_global_step_saved, self._last_checkpoint_saved, self._timed.mirrors
        )

    def _mirrored(self) -> None:
        super()._mirrored()
        self._timed.mirror_started(background=self._job.background)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]
        self._mirror(trainer)
        if self._fit is not None and self._fit.stop.sequence.requested():
            self._preemption_stop(trainer, where="at the end of training")
        self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        fit = self._fit
        if fit is not None and exception is fit.stop.sequence.stopped:
            return  # this callback's own stop: saved and committed (or missed) already
        super().on_exception(trainer, pl_module, exception)  # type: ignore[misc]
        try:
            # A SIGTERM (Lightning's SIGTERMException) or another failure: the attempt ends
            # once the upload in flight is done, a SIGTERM meanwhile only noted.
            with fit.stop.shielded() if fit is not None else contextlib.nullcontext():
                self._settle(trainer, exception)
        except Exception as exc:  # never hide the exception that stopped training
            log.warning(
                "could not mirror %s to %r while handling %s: %s: %s", self.dirpath,
                self._taskpoint, type(exception).__name__, type(exc).__name__, exc,
            )
        finally:
            if fit is not None:
                fit.stop.sequence.close()
            # Lightning calls no teardown after a failure (one raised in teardown ends here too)
            self._job.release()

    def _settle(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """Mirror what the failure saved (``save_on_exception``, an ``OnExceptionCheckpoint``
        in ``dirpath``) and wait for this rank's uploads, within ``preempt_timeout`` and the
        grace period of a SIGTERM received."""
        fit = self._fit
        bound = self._preempt_timeout if fit is None else within_grace(self._preempt_timeout)
        deadline = None if bound is None else time.monotonic() + bound
        if fit is not None and fit.files.changed():
            self._unmirrored = True
        # The other ranks may not be here: no collective with several processes.
        if self._nodes is None and self._preemption_wait(bound):
            self._mirror(trainer)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._job_mirror is not None:  # every rank with an upload commits its own part
            self._job_mirror.settle_failed(exception, left, trainer.global_step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit":
            fit = self._fit
            if fit is not None and fit.files.changed():  # OnExceptionCheckpoint removed its file
                self._unmirrored = True
            # Lightning has shut its checkpoint plugins down by now: every write is done.
            self._mirror(trainer, final=True)
            self._finish(trainer)
            if fit is not None:
                fit.stop.sequence.close()
            self._job.release()  # the fit is over; the checkpoint stays open for a later fit

    # -- random state ------------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]
        stash_in_checkpoint(trainer, checkpoint)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]
        key: str = self.state_key
        self._rng_for_train_start = load_from_checkpoint(trainer, checkpoint, key)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]
        if self._rng_for_train_start is not None:
            _set_rng_states(self._rng_for_train_start)
            self._rng_for_train_start = None
        taskpoint.report_step(trainer.global_step)
        if self._fit is not None:
            self._fit.stop.take_over()


class TaskpointModelCheckpoint(_TaskpointMirror, ModelCheckpoint):
    """A Lightning ``ModelCheckpoint`` that mirrors its ``dirpath`` to a taskpoint store.

    Each time Lightning has finished a save (the file written, ``save_last`` written or
    linked, top-k pruning done: from ``every_n_train_steps``, ``every_n_epochs``,
    ``train_time_interval``, validation, ``save_on_exception``, or an
    ``OnExceptionCheckpoint`` saving into ``dirpath``), the whole ``dirpath`` is saved to
    the store as one checkpoint, so the store never holds a deleted or partially written
    file. The Lightning guide (``docs/frameworks/lightning.md``) tells the whole story:

    - with several processes and a :class:`taskpoint.Checkpoint`, every rank commits its
      disk's share of one checkpoint (:class:`taskpoint.checkpoint.job_mirror.JobMirror`);
    - uploads run in the background, one at a time; a failure raises at the next mirror or
      when training ends, which waits for the upload (so does an exception, within
      ``preempt_timeout``); figures go to ``trainer.loggers`` (``taskpoint/blocked_s``,
      ``upload_s``, ``uploaded_bytes``, ``stored_bytes``);
    - SIGTERM becomes a save (inside a task, or ``save_on_preemption``): every rank stops
      at one step boundary, saves the ``last`` checkpoint when it fits in
      ``TASKPOINT_GRACE_PERIOD``, waits for its commit and raises
      :class:`taskpoint.Preempted` (see :mod:`taskpoint_lightning._preemption`);
    - every rank's global random state is kept in the checkpoint and restored, so a
      resumed run draws what an uninterrupted one would;
    - ``train_time_interval`` saves by training time at step boundaries (also in manual
      optimization); ``"auto"`` chooses the interval with :class:`taskpoint.SaveInterval`
      (:attr:`save_interval` tells what and why).

    Resume with :func:`taskpoint_lightning.resume_ckpt_path`.

    Args:
        checkpoint: where to mirror: a :class:`taskpoint.Checkpoint`,
            ``taskpoint.ctx().checkpoint`` or any :class:`taskpoint.CheckpointLike`.
        *args: ``ModelCheckpoint``'s positional arguments (``dirpath``, ``filename``, ...).
        blocking: upload inside the hook that saved, training waiting for the commit.
            ``None`` (the default): in the background for a :class:`taskpoint.Checkpoint`;
            blocking for another system's checkpoint (Flyte's), whose attempt may hand its
            checkpoint on before a background upload lands.
        preempt_timeout: how many seconds an exception or SIGTERM waits for the upload in
            flight; ``None`` waits as long as it takes. A SIGTERM's grace period bounds it
            too.
        save_on_preemption: whether SIGTERM becomes a save. ``None`` (the default):
            ``TASKPOINT_SAVE_ON_PREEMPTION`` when set, else only inside a taskpoint task
            (see :func:`taskpoint.preemption.save_on_preemption`). With several processes,
            global rank zero's choice holds for all.
        timeout: with several processes, how many seconds a rank waits for the others at
            each step of a mirror (the uploads included).
        **kwargs: ``ModelCheckpoint``'s keyword arguments: ``dirpath``, ``filename``,
            ``monitor``, ``save_last`` (``True`` or ``"link"``), ``save_top_k``,
            ``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval`` (a
            ``timedelta``, ``"auto"`` or a :class:`taskpoint.SaveInterval`; see above), ...

    Raises:
        TypeError: ``checkpoint`` is not checkpoint-like (``None`` included), or
            ``train_time_interval`` is neither a ``timedelta``, ``"auto"`` nor a
            :class:`taskpoint.SaveInterval`.
        ValueError: ``preempt_timeout`` is negative, ``timeout`` not positive,
            ``train_time_interval`` not positive or set with ``every_n_train_steps`` or
            ``every_n_epochs``, ``TASKPOINT_MTBF_PRIOR_S`` unusable; at setup,
            ``dirpath`` is not a local folder, or ``TASKPOINT_SAVE_ON_PREEMPTION`` /
            ``TASKPOINT_GRACE_PERIOD`` hold something unusable.
        taskpoint.Preempted: a SIGTERM stopped training (after its save committed or
            was missed).
        taskpoint.CheckpointError: a mirror failed (after the store's own retries); the
            training stops and a retry resumes from the previous mirror. A mirror failing
            while Lightning handles another exception is logged instead, so that
            exception is the one raised.
    """

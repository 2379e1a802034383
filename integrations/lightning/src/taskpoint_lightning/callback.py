"""``TaskpointModelCheckpoint``: a ``ModelCheckpoint`` that mirrors its folder to the store.

Example::

    import lightning as L
    import taskpoint
    from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path

    ckpt = taskpoint.ctx().checkpoint            # or taskpoint.Checkpoint("s3://b/run-1")
    mc = TaskpointModelCheckpoint(ckpt, dirpath="ckpts", save_last=True)
    trainer = L.Trainer(max_epochs=10, callbacks=[mc])
    trainer.fit(model, ckpt_path=resume_ckpt_path(ckpt, dirpath="ckpts"))

Each mirror uploads in the background while training goes on; what each cost is logged to
the Trainer's loggers as ``taskpoint/blocked_s``, ``taskpoint/upload_s``,
``taskpoint/uploaded_bytes`` and ``taskpoint/stored_bytes``. A SIGTERM becomes a save at the
next step boundary (see :mod:`taskpoint_lightning._preemption`).
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
from lightning.pytorch.callbacks import ModelCheckpoint
from taskpoint import CheckpointLike
from taskpoint.integration import JobMirror, check_timeout

from taskpoint_lightning._interval import TimedSaves, check_time_interval
from taskpoint_lightning._mirroring import Fit, Mirroring, describe
from taskpoint_lightning._on_exception import ExceptionFiles
from taskpoint_lightning._preemption import Preemption
from taskpoint_lightning._rng import (
    RNG_STATE_KEY,
    load_from_checkpoint,
    restore_rng,
    stash_in_checkpoint,
)
from taskpoint_lightning.resume import filled_by_resume

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RNG_STATE_KEY", "TaskpointModelCheckpoint"]

log = logging.getLogger(__name__)


def _check_checkpoint(checkpoint: object, owner: str) -> CheckpointLike:
    if not isinstance(checkpoint, CheckpointLike):
        hint = (
            " (taskpoint.ctx().checkpoint is None outside a task or when checkpoints are "
            "off; pass taskpoint.Checkpoint(url) instead)"
            if checkpoint is None
            else ""
        )
        raise TypeError(
            f"{owner} takes a checkpoint with save/save_sync/load/load_sync (a "
            f"taskpoint.Checkpoint, taskpoint.ctx().checkpoint or another CheckpointLike) "
            f"as its first argument; got {type(checkpoint).__name__}{hint}"
        )
    return checkpoint


def _at_step_boundary(trainer: pl.Trainer) -> bool:
    """Whether the batch just done applied its gradients (not inside an accumulation)."""
    should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
    return not (callable(should_accumulate) and should_accumulate())


def _check_alone(timed: object, kwargs: dict[str, Any], owner: str) -> None:
    """``train_time_interval`` excludes ``every_n_train_steps`` and ``every_n_epochs``, as
    in ``ModelCheckpoint``.

    Raises:
        ValueError: either is set as well.
    """
    for name in ("every_n_train_steps", "every_n_epochs"):
        value = kwargs.get(name)
        if value:
            raise ValueError(
                f"{owner}: train_time_interval={timed!r} and {name}={value!r} are mutually "
                "exclusive (as in Lightning's ModelCheckpoint): save by time or by count"
            )


class _TaskpointMirror(Mirroring):
    """The adapter's behaviour, mixed into a Lightning ``ModelCheckpoint`` class.

    Kept apart from the base class so the same code serves both ``lightning.pytorch``
    and the standalone ``pytorch_lightning`` package.
    """

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
        self._taskpoint = _check_checkpoint(checkpoint, type(self).__name__)
        try:
            self._timeout = check_timeout(timeout)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        if preempt_timeout is not None and not preempt_timeout >= 0:
            raise ValueError(
                f"{type(self).__name__}: preempt_timeout must be a number of seconds >= 0 or "
                f"None; got {preempt_timeout!r}"
            )
        timed = check_time_interval(kwargs.pop("train_time_interval", None), type(self).__name__)
        if timed is not None:
            _check_alone(timed, kwargs, type(self).__name__)
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
        # __getstate__): the upload thread, the task contexts told to wait for it, the fit's.
        self._job_mirror: JobMirror | None = None
        self._preempt_contexts: list[taskpoint.TaskContext] = []
        self._fit: Fit | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What pickling and ``copy.deepcopy`` carry (Lightning's ``ddp_spawn`` pickles the
        callbacks for its workers): the settings and Lightning's state, and the checkpoint,
        which travels as its configuration. The upload machinery, the process group's
        coordinators, the task contexts and the fit's SIGTERM handling belong to this
        process; the copy makes its own.

        Waits first for the mirror in flight, so no upload is left behind uncommitted.

        Raises:
            taskpoint.CheckpointError: the mirror in flight failed.
        """
        if self._job_mirror is not None:
            self._job_mirror.uploads.wait()
        state = dict(self.__dict__)
        state.update(_job_mirror=None, _preempt_contexts=[], _fit=None)
        return state

    @property
    def checkpoint(self) -> CheckpointLike:
        """The store checkpoint that ``dirpath`` is mirrored to."""
        return self._taskpoint

    @property
    def save_interval(self) -> taskpoint.IntervalChoice | None:
        """The interval of the saves by training time (``train_time_interval``) now in
        force, and for ``"auto"`` what it was chosen from (its ``metrics()`` are the
        ``taskpoint/*`` figures logged beside each save). ``None`` without
        ``train_time_interval``, or before setup. Local to this rank: global rank zero's
        decides."""
        interval = self._timed.interval
        return None if interval is None else interval.choice

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
        if self.dirpath is not None and not _is_local_file_protocol(self.dirpath):
            raise ValueError(
                f"{type(self).__name__} mirrors a local folder to the store, but "
                f"dirpath={self.dirpath!r} is remote; give it a local dirpath (the store "
                "holds the durable copy)"
            )
        if trainer.is_global_zero:
            self._wait_on_preempt()
        if self.dirpath is not None:
            self._job.join(Path(self.dirpath))
        if stage == "fit":
            self._timed.start(self._taskpoint)
            if self._fit is not None:
                self._fit.stop.close()
            files = ExceptionFiles.find(trainer, self, os.fspath(self.dirpath or "."))
            stop = Preemption.start(trainer, self._save_on_preemption, self._timeout)
            self._fit = Fit(stop, files if self.dirpath is not None else ExceptionFiles([]))

    # -- the hooks that save: mirror once each has written and pruned --------------------

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        taskpoint.report_step(trainer.global_step)
        with self._timed.measured(trainer, self._save_token):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]
            if _at_step_boundary(trainer) and self._timed.due(trainer):
                self._save_on_time(trainer)
            self._mirror(trainer)
        fit = self._fit
        if fit is not None and _at_step_boundary(trainer) and fit.stop.requested():
            where = f"after batch {batch_idx} of epoch {trainer.current_epoch}"
            fit.stop.stop(trainer, self, where=where, checkpoint=self._taskpoint)

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
        # A background upload through the checkpoint (one writer) ends at its commit, which
        # the save interval hears of; a part of several writers' runs in the mirror's thread.
        self._timed.mirror_started(
            background=self._nodes is None and not self._uploads.blocking
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]
        self._mirror(trainer)
        if self._fit is not None and self._fit.stop.requested():
            self._fit.stop.stop(
                trainer, self, where="at the end of training", checkpoint=self._taskpoint
            )
        self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        fit = self._fit
        if fit is not None and fit.stop.raised(exception):
            return  # this callback's own stop: saved and committed (or missed) already
        super().on_exception(trainer, pl_module, exception)  # type: ignore[misc]
        try:
            # A SIGTERM (Lightning's SIGTERMException) or another failure: the attempt ends
            # once the upload in flight is done, a SIGTERM meanwhile only noted.
            with fit.stop.shielded() if fit is not None else contextlib.nullcontext():
                self._settle(trainer, exception)
        except Exception as exc:  # never hide the exception that stopped training
            log.warning(
                "could not mirror %s to %s while handling %s: %s: %s", self.dirpath,
                describe(self._taskpoint), type(exception).__name__, type(exc).__name__, exc,
            )
        finally:
            if fit is not None:
                fit.stop.close()

    def _settle(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """Mirror what the failure saved (``save_on_exception``, an ``OnExceptionCheckpoint``
        in ``dirpath``) and wait for this rank's uploads, within ``preempt_timeout`` and the
        grace period of a SIGTERM received."""
        fit = self._fit
        bound = self._preempt_timeout if fit is None else fit.stop.bound(self._preempt_timeout)
        deadline = None if bound is None else time.monotonic() + bound
        if fit is not None and fit.files.changed():
            self._unmirrored = True
        # The other ranks may not be here: no collective with several processes.
        if self._nodes is None and self._preemption_wait(trainer, bound):
            self._mirror(trainer)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        # Every rank with an upload: with several processes each commits its own part.
        if self._job_mirror is not None and not self._job_mirror.uploads.wait(left):
            log.warning(
                "the mirror of %s to %s still runs after %ss; %s ends the attempt without "
                "it (the store keeps the mirror before)", self.dirpath,
                describe(self._taskpoint), bound, type(exception).__name__,
            )

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
                fit.stop.close()

    def _wait_on_preempt(self) -> None:
        """Inside a taskpoint task, make its SIGTERM handler wait for the mirror in flight
        (once per task context) when the signal comes outside training (during training
        with ``save_on_preemption``, the stop at the next step boundary does)."""
        context = taskpoint.ctx()
        if context is None or any(c is context for c in self._preempt_contexts):
            return
        self._preempt_contexts.append(context)
        context.on_preempt(self._on_preempt)

    def _on_preempt(self) -> None:
        self._job.wait_on_signal(self._preempt_timeout)

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
            restore_rng(self._rng_for_train_start)
            self._rng_for_train_start = None
        taskpoint.report_step(trainer.global_step)
        if self._fit is not None:
            self._fit.stop.take_over()


class TaskpointModelCheckpoint(_TaskpointMirror, ModelCheckpoint):
    """A Lightning ``ModelCheckpoint`` that mirrors its ``dirpath`` to a taskpoint store.

    Each time Lightning has finished a save (the file written, ``save_last`` written or
    linked, top-k pruning done), global rank zero saves the whole ``dirpath`` to the store
    as one checkpoint, so the store never holds a deleted or partially written file.

    With several processes (a ``torch.distributed`` process group) and a
    :class:`taskpoint.Checkpoint`, every rank takes part instead: at setup the ranks find
    out which of them share ``dirpath`` (a token file each); at each mirror the first rank
    of each disk stages its share (another disk adds only the files inside top-level
    folders rank 0's disk also has, such as its shards of a sharded checkpoint's folder),
    and all parts are committed as one checkpoint with
    :meth:`taskpoint.Checkpoint.save_part_sync`. A failure on one rank fails the mirror on
    every rank; a rank that never arrives fails the others after ``timeout`` seconds.

    By default the upload runs in the background: rank zero takes a snapshot of
    ``dirpath`` (hard links where the disk allows, a copy otherwise), starts uploading it
    and training goes on. A file Lightning writes again (``last.ckpt``) is written as a
    new file, so the snapshot keeps the old one. At most one upload is in flight: a mirror
    while the previous upload still runs waits for it first. A failed upload raises its
    error at the next mirror or when training ends (``on_train_end``, ``teardown``), which
    also waits for the upload in flight. When training stops on an exception (on one rank
    or all), every rank's upload in flight is finished before the exception goes on, within
    ``preempt_timeout`` seconds and the grace period of a SIGTERM received meanwhile (which
    only ends the wait early; Lightning's handler, whose collective fails once a rank is
    gone, is set aside during it).

    SIGTERM becomes a save (inside a taskpoint task, or with ``save_on_preemption=True`` or
    ``TASKPOINT_SAVE_ON_PREEMPTION=1``): the signal is noted, every rank votes at each step
    boundary (``on_train_batch_end`` once the step's gradients are applied, and
    ``on_train_end``), and at the first vote after it all ranks stop at the same step. They
    finish the upload in flight, agree on the earliest deadline
    (``TASKPOINT_GRACE_PERIOD`` seconds after the signal, default 30) and, when the last
    save's duration says a save fits, save the state at that step as the ``last``
    checkpoint (``last.ckpt``, a file even with ``save_last="link"`` or without
    ``save_last``; none when a save at that step exists), mirror it (only changed chunks are
    uploaded) and wait for the commit. Then :class:`taskpoint.Preempted` is raised on every
    rank, so Lightning's exception path (``on_exception``, teardown) runs and no code after
    ``fit`` runs as if training had finished; the next attempt resumes at that step. A save
    that does not fit is skipped with a WARNING: the previous checkpoint stays and the
    attempt's record says the preemption save was ``missed``. While this is on, Lightning's
    own SIGTERM handling (``trainer.received_sigterm``, ``SIGTERMException``) is set aside
    during training. Without ``save_last``, the ``last`` file of a preemption save is
    removed again at the next save, which supersedes it. The training step
    (``trainer.global_step``) is reported with :func:`taskpoint.report_step` at each batch
    end, so saves and the attempt records carry it.

    What each mirror cost is logged to the Trainer's loggers (``trainer.loggers``) at the
    next hook after it committed: ``taskpoint/blocked_s`` (how long training waited),
    ``taskpoint/upload_s``, and where the checkpoint reports them (a
    :class:`taskpoint.Checkpoint` does) ``taskpoint/uploaded_bytes`` and
    ``taskpoint/stored_bytes``.
    Saves from ``every_n_train_steps`` (mid-epoch), ``every_n_epochs``,
    ``train_time_interval``, validation and ``save_on_exception`` are all mirrored, and so
    is the file of a Lightning ``OnExceptionCheckpoint`` saving into ``dirpath`` (its
    ``on_exception`` is made to run before this callback's; one saving elsewhere is named
    in a WARNING at setup). Writes queued by Lightning's ``AsyncCheckpointIO`` are waited
    for first.

    The callback also keeps the global random state (Python, NumPy, torch, and CUDA when
    training on it; every rank's) in the checkpoint and restores it when Lightning loads
    the checkpoint, so a resumed run draws the same dropout masks and shuffles as an
    uninterrupted one. Mid-epoch resumes are exact when the dataloader is resumable
    (implements ``state_dict``/``load_state_dict``, as torchdata's
    ``StatefulDataLoader`` does).

    Saves by training time: ``train_time_interval`` (a ``timedelta``) saves the top-k
    and ``last`` checkpoints once that much time has passed since the last save, whatever
    made it, at a step boundary: in automatic and manual optimization alike (Lightning's
    own check runs in automatic optimization only). ``train_time_interval="auto"``
    chooses the interval with :class:`taskpoint.SaveInterval`: Young and Daly's
    ``sqrt(2 x cost x mean time between failures)``, from what a save costs training here
    (the hook's time, the snapshot for the upload included, plus what the background upload
    takes from the steps beside it) and the run's failures in the store's attempt records
    (until there are some, a prior: ``TASKPOINT_MTBF_PRIOR_S``, four hours by default),
    within 2% of training time and an hour at most. The first save then comes at the first
    step, to measure its cost. For other bounds pass
    ``taskpoint.SaveInterval.for_checkpoint(checkpoint, "auto", mtbf_prior_s=...,
    max_overhead=..., max_interval_s=...)`` itself. Global rank zero's clock decides and
    every rank saves at the same step (one ``strategy.broadcast`` per step boundary). As
    in ``ModelCheckpoint``, it excludes ``every_n_train_steps`` and ``every_n_epochs``.
    With a preemption warning (SIGTERM turned into a save) the interval only has to cover
    the failures that come without one. :attr:`save_interval` tells what was chosen and
    why; each change is logged at INFO and recorded in the attempt's records
    (``taskpoint show``).

    Resume with :func:`taskpoint_lightning.resume_ckpt_path`.

    Args:
        checkpoint: where to mirror: a :class:`taskpoint.Checkpoint`,
            ``taskpoint.ctx().checkpoint`` or any :class:`taskpoint.CheckpointLike`.
        *args: ``ModelCheckpoint``'s positional arguments (``dirpath``, ``filename``, ...).
        blocking: upload inside the hook that saved, training waiting until it has
            committed (the behaviour before background uploads). ``None`` (the default): in the
            background for a :class:`taskpoint.Checkpoint`, whose task waits for it; blocking
            for another system's checkpoint (Flyte's), whose attempt may end and hand its
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

    Example::

        ckpt = taskpoint.ctx().checkpoint
        mc = TaskpointModelCheckpoint(ckpt, dirpath="ckpts", save_last=True,
                                      every_n_train_steps=100)
        trainer = L.Trainer(max_steps=10_000, callbacks=[mc])
        trainer.fit(model, ckpt_path=resume_ckpt_path(ckpt, dirpath="ckpts"))
    """

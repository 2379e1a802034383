"""How ``TaskpointModelCheckpoint`` notes each change Lightning makes to ``dirpath`` and
mirrors it (core's job-wide mirror), the saves a SIGTERM asks for included."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from taskpoint import CheckpointLike
from taskpoint.integration import (
    JobMirror,
    Nodes,
    requested,
    unshare,
    warn,
    within_grace,
)

from taskpoint_lightning._mirror import flush_async_io, unfinished_files
from taskpoint_lightning._on_exception import ExceptionFiles
from taskpoint_lightning._preemption import Preemption

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Fit", "Mirroring"]

log = logging.getLogger(__name__)


@dataclass
class Fit:
    """One fit's machinery: its SIGTERM handling, the ``OnExceptionCheckpoint`` files in
    ``dirpath``, and what the last save cost this rank (seconds)."""

    stop: Preemption
    files: ExceptionFiles
    write_s: float = 0.0
    upload_s: float = 0.0
    flagged: bool = False  # the last mirror started after a preemption notice


def _last_state(path: str) -> tuple[str, str | None]:
    """``save_last``'s file, and where it links to if it is a link."""
    try:
        return path, os.readlink(path) if path and os.path.islink(path) else None
    except OSError:
        return path, None


class Mirroring:
    """Mixed into the callback: the saves, the mirrors, and the waits for them."""

    # Set by the callback and by ModelCheckpoint; declared for readers.
    dirpath: Any
    last_model_path: str
    save_last: Any
    CHECKPOINT_NAME_LAST: str
    _last_checkpoint_saved: str
    _last_global_step_saved: int
    _taskpoint: CheckpointLike
    _blocking: bool | None
    _timeout: float
    _unmirrored: bool
    _job_mirror: JobMirror | None
    _fit: Fit | None

    @property
    def _job(self) -> JobMirror:
        """The mirror of ``dirpath`` to the store, made at first use."""
        if self._job_mirror is None:
            self._job_mirror = JobMirror(
                self._taskpoint, blocking=self._blocking, timeout=self._timeout
            )
        return self._job_mirror

    @property
    def _nodes(self) -> Nodes | None:
        """Every rank's part of the mirror, once setup found several processes."""
        return None if self._job_mirror is None else self._job_mirror.nodes

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the mirror in flight (if any) has committed: ``True`` once no upload
        runs, ``False`` if ``timeout`` seconds (``None``: no limit) ran out first.

        Raises:
            taskpoint.CheckpointError: the upload failed.
        """
        return self._job_mirror is None or self._job_mirror.uploads.wait(timeout)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.is_global_zero:
            # torch.save rewrites an existing file (last.ckpt) in place; a snapshot still
            # uploading may hold a hard link to it, so give the new content a new file.
            unshare(filepath, copy=False)
        stale = self._stale_preemption_last(filepath)
        if stale:
            self.last_model_path = ""  # part of the state the save writes
        started = time.monotonic()
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        if self._fit is not None:
            self._fit.write_s = time.monotonic() - started
        self._unmirrored = True
        if stale:
            self._remove_checkpoint(trainer, stale)

    def _stale_preemption_last(self, filepath: str) -> str | None:
        """Without ``save_last``, the ``last`` file a preemption save wrote (and a run may
        have resumed from), once another save supersedes it: it would otherwise stay the
        newest ``last*.ckpt`` that ``resume_ckpt_path`` picks."""
        last = self.last_model_path
        if self.save_last or not last or os.path.realpath(last) == os.path.realpath(filepath):
            return None
        folder = os.path.realpath(self.dirpath) if self.dirpath is not None else None
        return last if folder and os.path.dirname(os.path.realpath(last)) == folder else None

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: Any) -> None:
        # save_last="link" only (re)makes a link, often to the file it already names.
        before = _last_state(self.last_model_path)
        super()._save_last_checkpoint(trainer, monitor_candidates)  # type: ignore[misc]
        # Several processes decide together whether to mirror: every rank must agree, and
        # only global rank zero makes the link, so any call counts there.
        if self._nodes is not None or _last_state(self.last_model_path) != before:
            self._unmirrored = True

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)  # type: ignore[misc]
        self._unmirrored = True

    def _finish(self, trainer: pl.Trainer) -> None:
        """Wait for the mirror in flight (raising its error; within the grace period of a
        SIGTERM received) and log what is left."""
        bound = None if self._fit is None else within_grace(None)
        self._job.finish(bound, leader=trainer.is_global_zero)
        if trainer.is_global_zero:
            self._log_stats(trainer)

    def _log_stats(self, trainer: pl.Trainer) -> None:
        """Log the figures of the mirrors committed since the last call (global rank 0)."""
        for stats in self._job.uploads.take_stats():
            metrics = stats.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            if self._fit is not None:
                self._fit.upload_s = stats.blocked_s + (stats.upload_s or 0.0)

    def _mirror(self, trainer: pl.Trainer, *, final: bool = False) -> None:
        """Start saving ``dirpath`` to the store if Lightning changed it since the last
        mirror (with several processes, every rank commits its disk's share as one
        checkpoint); log the figures of mirrors committed since the last hook."""
        if trainer.is_global_zero:
            self._log_stats(trainer)
        if not self._unmirrored:
            return
        parts = self._nodes is not None and self.dirpath is not None
        if not parts and (not trainer.is_global_zero or self.dirpath is None):
            self._unmirrored = False
            return
        root = Path(self.dirpath)
        if self._put_off(trainer, root, final=final, everywhere=parts):
            return
        self._job.save(root, step=trainer.global_step, leader=trainer.is_global_zero)
        self._mirrored()

    def _put_off(self, trainer: pl.Trainer, root: Path, *, final: bool, everywhere: bool) -> bool:
        """Whether ``root`` holds files not fully written, so its mirror waits for the next
        save: global rank zero looks (queued async writes done first) and, ``everywhere``,
        tells every rank (a collective). It says why, loudly when training has ended."""
        flush_async_io(trainer.strategy.checkpoint_io)
        problems = (
            unfinished_files(root, [self._last_checkpoint_saved])
            if trainer.is_global_zero else []
        )
        if everywhere:
            problems = self._job.everywhere(lambda: problems, "check its checkpoint files")[0]
        if problems and trainer.is_global_zero:
            message = f"not mirroring {root} to {self._taskpoint!r} yet: " + "; ".join(
                problems
            )
            if not final:
                log.info("%s; trying again after the next save", message)
            elif everywhere:
                log.warning(message)
            else:
                message += " (training has ended: the store keeps the previous mirror)"
                warn(log, message, stacklevel=3)
        return bool(problems)

    def _mirrored(self) -> None:
        """Note that the mirror of the folder as it is now has started."""
        self._unmirrored = False
        if self._fit is not None:
            self._fit.flagged = requested()
            self._fit.files.mirrored()

    # -- a SIGTERM's save (see _preemption) -------------------------------------------

    def _preemption_stop(self, trainer: pl.Trainer, *, where: str) -> NoReturn:
        """Save at this step boundary (every rank; ``where`` names it), wait for the commit
        and raise (outside a task global rank zero first records the end as preempted in
        the checkpoint): core's stop sequence, with this callback's save and mirror.

        Raises:
            taskpoint.Preempted: always, once the stop is done (saved or not).
        """
        fit = self._fit
        assert fit is not None  # a stop is requested only within a fit
        stop, step = fit.stop.sequence, trainer.global_step
        if self._job_mirror is not None and self._job_mirror.uploads.drop_waiting():
            # The mirror waiting behind the upload in flight is dropped: the preemption's
            # own mirror goes first and saves the folder anew.
            self._unmirrored = True
        decision = stop.decide(
            step, wait=lambda timeout: self._preemption_wait(timeout),
            estimate=lambda: fit.write_s + fit.upload_s, also=lambda: [fit.flagged],
        )
        started = time.monotonic()
        if not decision.saving:
            outcome = f"missed: {decision.reason} (the store keeps the previous checkpoint)"
        else:
            saved = None
            if self._last_global_step_saved != step:
                saved = self._save_newest_last(trainer)
            elif not decision.agreed[0]:
                # The save at this step began before the notice (some rank's last mirror
                # started before it): mirror it once more (the same files, nothing new to
                # upload) so that its commit counts as the preemption's.
                self._unmirrored = True
            self._mirror(trainer)
            # Also a barrier: no rank ends (torchrun then stops the others) before the commit.
            committed = stop.committed(
                lambda timeout: not self._unmirrored and self._preemption_wait(timeout)
            )
            what = f"saved {saved}" if saved else "the save at this step"
            outcome = (
                f"{what} and committed it in {time.monotonic() - started:.1f}s"
                if committed else
                f"missed: {what} did not commit within the grace period (the store keeps "
                "the previous checkpoint)"
            )
        stop.end(
            f"{decision.signal} received: stopped at step {step} ({where}); {outcome}",
            step=step, leader=trainer.is_global_zero, checkpoint=self._taskpoint,
        )

    def _preemption_wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for this rank's upload in flight; whether none
        runs any more (a failed one, logged, counts as done: the folder is mirrored again)."""
        job = self._job_mirror
        if job is None:
            return True
        job.lost = None
        done = job.settle(timeout)
        if job.lost is not None:
            self._unmirrored = True
        return done is not False

    def _save_newest_last(self, trainer: pl.Trainer) -> str:
        """Save the state at this step as the ``last`` checkpoint, a file even with
        ``save_last="link"`` or without ``save_last``, as ``_save_last_checkpoint`` names it
        (``resume_ckpt_path`` and Lightning's ``ckpt_path="last"`` resume from it)."""
        candidates = self._monitor_candidates(trainer)  # type: ignore[attr-defined]
        name = self.format_checkpoint_name  # type: ignore[attr-defined]
        filepath: str = name(candidates, self.CHECKPOINT_NAME_LAST)
        if getattr(self, "_enable_version_counter", False):
            version = self.STARTING_VERSION  # type: ignore[attr-defined]
            while self.file_exists(filepath, trainer) and filepath != self.last_model_path:  # type: ignore[attr-defined]
                filepath = name(candidates, self.CHECKPOINT_NAME_LAST, ver=version)
                version += 1
        previous, self.last_model_path = self.last_model_path, filepath
        self._save_checkpoint(trainer, filepath)
        if previous and self._should_remove_checkpoint(trainer, previous, filepath):  # type: ignore[attr-defined]
            self._remove_checkpoint(trainer, previous)
        return filepath

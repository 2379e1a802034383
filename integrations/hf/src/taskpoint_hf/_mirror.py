"""The callback's saves of ``output_dir`` (core's job-wide mirror) and what each cost."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from taskpoint import CheckpointLike
from taskpoint.integration import JobMirror, MirrorStats, barrier, combined_metrics, unshare
from transformers import TrainerControl, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from taskpoint_hf.resume import TRAINER_STATE, _scan

__all__ = ["OutputMirror", "marks"]

log = logging.getLogger(__name__)


def marks(folder: Path) -> dict[str, int]:
    """Each complete ``checkpoint-N`` in ``folder`` and when its ``trainer_state.json`` (the
    file the Trainer writes last) was written: a checkpoint written again under the same
    name (a just-in-time one) changes its mark."""
    found = {}
    for path in _scan(folder).complete:
        try:
            found[path.name] = (path / TRAINER_STATE).stat().st_mtime_ns
        except OSError:
            continue
    return found


class OutputMirror(JobMirror):
    """The job-wide mirror of ``output_dir``, and what the Trainer's saves and logs need of
    it (arguments as :class:`JobMirror`'s)."""

    def __init__(self, checkpoint: CheckpointLike, *, blocking: bool | None, timeout: float) -> None:
        super().__init__(checkpoint, blocking=blocking, timeout=timeout)
        self.step: int | None = None  # of the last save
        self.mirrored: dict[str, int] | None = None  # marks() of what was saved
        self.deferred: BaseException | None = None  # an upload error met while logging
        self._stats: list[MirrorStats] = []  # committed saves not logged yet
        self._cost: float | None = None  # seconds the last save took, write to commit
        self._asked: float | None = None  # when the Trainer was told to save
        self._writes: dict[int | None, float] = {}  # step: seconds its checkpoint-N took

    def start(self, folder: Path) -> None:
        """At training start (every rank: collectives in a multi-process job)."""
        self.mirrored = marks(folder)
        self.step = None  # no save yet: none of this training's steps is mirrored
        self.join(folder)

    def save(self, folder: Path, *, step: int | None, leader: bool) -> bool:
        """As :meth:`JobMirror.save` once every rank has written its files (every rank calls
        this), an upload error met while logging raised first."""
        barrier()  # every rank has written its files into checkpoint-N
        try:
            self.raise_deferred()
            saved = super().save(folder, step=step, leader=leader)
            if saved:
                self.step = step
                self.mirrored = marks(folder)
            return saved
        finally:
            if self.nodes is None and self.uploads.blocking:
                barrier()  # nobody writes the next checkpoint during the upload

    def asked(self, control: TrainerControl) -> None:
        """The Trainer may have been told to save: its write starts now."""
        if control.should_save and self._asked is None:
            self._asked = time.monotonic()

    def written(self, step: int) -> None:
        """The Trainer has written ``checkpoint-<step>``."""
        if self._asked is not None:
            self._writes = {step: time.monotonic() - self._asked}
            self._asked = None

    def unshare_next(self, output_dir: Path, step: int, *, saving: bool) -> None:
        """Before the Trainer writes ``checkpoint-<step>`` (``saving``: it was told to, on
        every rank), give its files their own copies if an upload's snapshot still shares
        them: a resumed run writes an existing ``checkpoint-N`` again, in place. In a
        multi-writer job each disk's leading rank copies while the others wait (two ranks
        copying one shared folder would each find the other's temporary files)."""
        if not saving or not self.uploads.uploading:
            return
        if self.leads:
            target = output_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
            copied = unshare(target)
            if copied:
                log.info(
                    "%s is about to be written again while an upload reads it: gave %d "
                    "file(s) their own copy", target, copied,
                )
        if self.nodes is not None:
            barrier()  # no rank writes before its disk's files are copied

    def raise_deferred(self) -> None:
        error, self.deferred = self.deferred, None
        if error is not None:
            raise error

    def finish(self, timeout: float | None, *, leader: bool) -> bool:
        """As :meth:`JobMirror.finish`, an upload error met while logging raised first."""
        self.raise_deferred()
        return super().finish(timeout, leader=leader)

    def _collect(self) -> None:
        """Move the committed saves' figures here, and remember what the last one cost."""
        for stats in self.uploads.take_stats():
            self._stats.append(stats)
            if stats.upload_s is not None:
                written = self._writes.get(stats.step, 0.0)
                self._cost = written + stats.blocked_s + stats.upload_s

    def figures(
        self, state: TrainerState, control: TrainerControl, stopping: bool
    ) -> dict[str, float]:
        """The figures for the Trainer's logs (world process zero). At its last logs
        (training stops, this step's checkpoint already saved) the upload in flight is
        waited for first, so the last save's figures are logged too; its error is raised
        at ``on_train_end``. After a SIGTERM (``stopping``) ``on_train_end`` waits instead,
        within the grace period."""
        if (
            control.should_training_stop
            and self.step == state.global_step
            and self.nodes is None
            and self.deferred is None
            and not stopping
        ):
            try:
                self.uploads.wait()
            except BaseException as exc:  # raised where it always was, at on_train_end
                self.deferred = exc
        return self.take_metrics()

    def take_metrics(self) -> dict[str, float]:
        """The ``taskpoint/*`` figures of the saves committed since the last call."""
        self._collect()
        stats, self._stats = self._stats, []
        return combined_metrics(stats)

    def estimate(self) -> float | None:
        """Seconds the last committed save took from the Trainer's write to the commit."""
        self._collect()
        return self._cost


def written_dir(output_dir: str | os.PathLike[str] | None) -> Path:
    """The Trainer's ``output_dir`` as a path.

    Raises:
        ValueError: it is ``None``.
    """
    if output_dir is None:
        raise ValueError(
            "TrainingArguments.output_dir is None: set it, the Trainer writes checkpoint-N there"
        )
    return Path(os.fspath(output_dir))

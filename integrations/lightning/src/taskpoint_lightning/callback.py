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
``taskpoint/uploaded_bytes`` and ``taskpoint/stored_bytes``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import taskpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from taskpoint import CheckpointLike, TaskpointWarning, nodes
from taskpoint.coordination import check_timeout
from taskpoint.mirror import FolderMirror, unshare
from taskpoint.torch_coordination import TorchCoordinator

from taskpoint_lightning._mirror import flush_async_io, unfinished_files
from taskpoint_lightning._rng import capture_rng, pick_rng, restore_rng
from taskpoint_lightning.resume import filled_by_resume

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RNG_STATE_KEY", "TaskpointModelCheckpoint"]

log = logging.getLogger(__name__)

RNG_STATE_KEY = "taskpoint_rng"
"""The top-level key of a Lightning checkpoint that holds the random state.

Checkpoints written by taskpoint-lightning 0.1 kept it in the callback's own entry
(``checkpoint["callbacks"][state_key]``); those still resume exactly."""


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


@dataclass(frozen=True)
class _Nodes:
    """A multi-process job's coordinators (one per thread) and its disks."""

    main: TorchCoordinator
    uploads: TorchCoordinator
    disks: nodes.Disks


def _describe(checkpoint: CheckpointLike) -> str:
    return str(getattr(checkpoint, "url", None) or type(checkpoint).__name__)


class _TaskpointMirror:
    """The adapter's behaviour, mixed into a Lightning ``ModelCheckpoint`` class.

    Kept apart from the base class so the same code serves both ``lightning.pytorch``
    and the standalone ``pytorch_lightning`` package.
    """

    # Set by ModelCheckpoint; declared for readers.
    dirpath: Any
    last_model_path: str
    _last_checkpoint_saved: str

    def __init__(
        self,
        checkpoint: CheckpointLike,
        *args: Any,
        blocking: bool | None = None,
        preempt_timeout: float | None = 60.0,
        timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        self._taskpoint = _check_checkpoint(checkpoint, type(self).__name__)
        try:
            self._timeout = check_timeout(timeout)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        self._nodes: _Nodes | None = None
        if preempt_timeout is not None and not preempt_timeout >= 0:
            raise ValueError(
                f"{type(self).__name__}: preempt_timeout must be a number of seconds >= 0 or "
                f"None; got {preempt_timeout!r}"
            )
        super().__init__(*args, **kwargs)
        self._blocking = blocking
        self._preempt_timeout = preempt_timeout
        self._unmirrored = False
        self._rng_for_train_start: dict[str, Any] | None = None
        # This process's machinery, made when first needed and never copied (see
        # __getstate__): the upload thread, the task contexts told to wait for it.
        self._folder_mirror: FolderMirror | None = None
        self._preempt_contexts: list[taskpoint.TaskContext] = []

    def __getstate__(self) -> dict[str, Any]:
        """What pickling and ``copy.deepcopy`` carry (Lightning's ``ddp_spawn`` pickles the
        callbacks for its workers): the settings and Lightning's state, and the checkpoint,
        which travels as its configuration. The upload machinery, the process group's
        coordinators and the task contexts belong to this process; the copy makes its own.

        Waits first for the mirror in flight, so no upload is left behind uncommitted.

        Raises:
            taskpoint.CheckpointError: the mirror in flight failed.
        """
        if self._folder_mirror is not None:
            self._folder_mirror.wait()
        state = dict(self.__dict__)
        state.update(_folder_mirror=None, _nodes=None, _preempt_contexts=[])
        return state

    @property
    def _uploads(self) -> FolderMirror:
        """The mirror of ``dirpath`` to the store, made at first use."""
        if self._folder_mirror is None:
            self._folder_mirror = FolderMirror(self._taskpoint, blocking=self._blocking)
        return self._folder_mirror

    @property
    def checkpoint(self) -> CheckpointLike:
        """The store checkpoint that ``dirpath`` is mirrored to."""
        return self._taskpoint

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the mirror in flight (if any) has committed.

        Args:
            timeout: give up after this many seconds (``None``: no limit).

        Returns:
            ``True`` once no upload runs; ``False`` if ``timeout`` ran out first.

        Raises:
            taskpoint.CheckpointError: the upload failed.
        """
        return self._folder_mirror is None or self._folder_mirror.wait(timeout)

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
        if self._nodes is None and self.dirpath is not None:
            self._nodes = self._find_nodes(trainer, Path(self.dirpath))

    def _find_nodes(self, trainer: pl.Trainer, root: Path) -> _Nodes | None:
        """Several processes saving to a taskpoint.Checkpoint: the coordinators and which
        ranks share ``dirpath``'s disk (collectives: every rank calls this once)."""
        import torch.distributed as dist

        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return None
        if not isinstance(self._taskpoint, taskpoint.Checkpoint):
            return None  # another system's checkpoint: global rank zero mirrors alone
        main = TorchCoordinator(timeout=self._timeout)
        uploads = TorchCoordinator(timeout=self._timeout)  # used by the upload thread only
        disks = nodes.find_disks(main, root)
        if disks.leads(main.rank):
            nodes.discard_stale_parts(root)
        return _Nodes(main, uploads, disks)

    # -- saving: note each change Lightning makes to dirpath ----------------------------

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.is_global_zero:
            # torch.save rewrites an existing file (last.ckpt) in place; a snapshot still
            # uploading may hold a hard link to it, so give the new content a new file.
            unshare(filepath, copy=False)
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        self._unmirrored = True

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

    # -- the hooks that save: mirror once each has written and pruned --------------------

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]
        self._mirror(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)  # type: ignore[misc]
        self._mirror(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)  # type: ignore[misc]
        self._mirror(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]
        self._mirror(trainer)
        self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        super().on_exception(trainer, pl_module, exception)  # type: ignore[misc]
        try:
            if self._nodes is None:  # the other ranks may not be here: no collective
                self._mirror(trainer)
            # A SIGTERM (Lightning's SIGTERMException, taskpoint's Preempted) or another
            # failure: the attempt ends once the upload in flight is done.
            if trainer.is_global_zero and not self._uploads.wait(self._preempt_timeout):
                log.warning(
                    "the mirror of %s to %s still runs after %ss; %s ends the attempt without "
                    "it (the store keeps the mirror before)", self.dirpath,
                    _describe(self._taskpoint), self._preempt_timeout, type(exception).__name__,
                )
        except Exception as exc:  # never hide the exception that stopped training
            log.warning(
                "could not mirror %s to %s while handling %s: %s: %s", self.dirpath,
                _describe(self._taskpoint), type(exception).__name__, type(exc).__name__, exc,
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit":
            # Lightning has shut its checkpoint plugins down by now: every write is done.
            self._mirror(trainer, final=True)
            self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        """Wait for the mirror in flight (raising its error) and log what is left."""
        if self._nodes is not None:  # every rank takes part in the upload
            nodes.run_everywhere(self._nodes.main, self._uploads.wait, "finish the last mirror")
        if trainer.is_global_zero:
            self._uploads.wait()
            self._log_stats(trainer)

    def _log_stats(self, trainer: pl.Trainer) -> None:
        """Log the figures of the mirrors committed since the last call (global rank 0)."""
        for stats in self._uploads.take_stats():
            metrics = stats.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _wait_on_preempt(self) -> None:
        """Inside a taskpoint task, make its SIGTERM handler wait for the mirror in flight
        (once per task context). Installed before Lightning's own handler, which then
        calls it."""
        context = taskpoint.ctx()
        if context is None or any(c is context for c in self._preempt_contexts):
            return
        self._preempt_contexts.append(context)
        context.on_preempt(self._on_preempt)

    def _on_preempt(self) -> None:
        try:
            if not self._uploads.wait(self._preempt_timeout):
                log.warning(
                    "SIGTERM: the mirror to %s still runs after %ss; ending the attempt "
                    "without it (the store keeps the mirror before)",
                    _describe(self._taskpoint), self._preempt_timeout,
                )
        except Exception as exc:  # the attempt ends with Preempted either way
            log.warning("SIGTERM: the mirror to %s failed: %s", _describe(self._taskpoint), exc)

    def _mirror(self, trainer: pl.Trainer, *, final: bool = False) -> None:
        """Start saving ``dirpath`` to the store if Lightning changed it since the last
        mirror; log the figures of mirrors committed since the last hook."""
        if trainer.is_global_zero:
            self._log_stats(trainer)
        if not self._unmirrored:
            return
        if self._nodes is not None and self.dirpath is not None:
            self._mirror_parts(trainer, self._nodes, Path(self.dirpath), final=final)
            return
        if not trainer.is_global_zero or self.dirpath is None:
            self._unmirrored = False
            return
        root = Path(self.dirpath)
        flush_async_io(trainer.strategy.checkpoint_io)
        problems = unfinished_files(root, [self._last_checkpoint_saved])
        if problems:
            message = (
                f"not mirroring {root} to {_describe(self._taskpoint)} yet: "
                + "; ".join(problems)
            )
            if final:
                message += " (training has ended: the store keeps the previous mirror)"
                log.warning(message)
                warnings.warn(message, TaskpointWarning, stacklevel=2)
            else:
                log.info("%s; trying again after the next save", message)
            return
        started = time.monotonic()
        self._uploads.save(root, step=trainer.global_step)
        self._unmirrored = False
        log.info(
            "%s %s to %s at step %d in %.2fs",
            "mirrored" if self._uploads.blocking else "started mirroring", root,
            _describe(self._taskpoint), trainer.global_step, time.monotonic() - started,
        )

    def _mirror_parts(
        self, trainer: pl.Trainer, ranks: _Nodes, root: Path, *, final: bool
    ) -> None:
        """Every rank commits its disk's share of ``dirpath`` (sharded checkpoints are
        written by every rank) as one checkpoint."""
        flush_async_io(trainer.strategy.checkpoint_io)
        problems = (
            unfinished_files(root, [self._last_checkpoint_saved])
            if trainer.is_global_zero else []
        )
        problems = nodes.run_everywhere(
            ranks.main, lambda: problems, "check its checkpoint files"
        )[0]
        if problems:
            if trainer.is_global_zero:
                message = (
                    f"not mirroring {root} to {_describe(self._taskpoint)} yet: "
                    + "; ".join(problems)
                )
                if final:
                    log.warning(message)
                else:
                    log.info("%s; trying again after the next save", message)
            return
        nodes.run_everywhere(ranks.main, self._uploads.wait, "finish the previous mirror")
        part = nodes.stage_part(ranks.main, root, ranks.disks)
        self._uploads.save_part(
            part, coordinator=ranks.uploads, step=trainer.global_step, remove=part.parent
        )
        self._unmirrored = False

    # -- random state ------------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]
        # Beside the callbacks' states, not in this callback's own: those stay plain
        # values, and the state is the process's, shared by every taskpoint callback
        # (the first one to see the checkpoint keeps it; every rank sees the same ones).
        if RNG_STATE_KEY not in checkpoint:
            checkpoint[RNG_STATE_KEY] = capture_rng(
                include_cuda=trainer.strategy.root_device.type == "cuda",
                mid_epoch=_mid_epoch(trainer),
            )

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]
        key: str = self.state_key  # type: ignore[attr-defined]
        stored = checkpoint.get(RNG_STATE_KEY)
        if stored is None:  # written by taskpoint-lightning 0.1: in the callback's entry
            mine = checkpoint.get("callbacks", {}).get(key)
            stored = mine.get(RNG_STATE_KEY) if isinstance(mine, dict) else None
        if stored is None:
            if trainer.is_global_zero:
                message = (
                    f"the checkpoint being resumed holds no random state from {key}: it "
                    "was saved by another callback or with save_weights_only=True, so the "
                    "resumed run's random draws will differ from an uninterrupted run's"
                )
                log.warning(message)
                warnings.warn(message, TaskpointWarning, stacklevel=2)
            return
        states = pick_rng(stored, trainer.global_rank)
        # Set now, before Lightning makes the resumed epoch's data iterator (a shuffle
        # draws from these generators), exactly where the uninterrupted run made it.
        restore_rng(states)
        if stored.get("mid_epoch"):
            # Saved inside an epoch, whose iterator the uninterrupted run had already
            # made: Lightning's re-made one drew from the generators; set them again.
            self._rng_for_train_start = states

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]
        if self._rng_for_train_start is not None:
            restore_rng(self._rng_for_train_start)
            self._rng_for_train_start = None


def _last_state(path: str) -> tuple[str, str | None]:
    """``save_last``'s file, and where it links to if it is a link."""
    try:
        return path, os.readlink(path) if path and os.path.islink(path) else None
    except OSError:
        return path, None


def _mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether training is inside an epoch whose batches are not all done."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.is_last_batch:
        return False
    total = trainer.num_training_batches
    return not (total != float("inf") and progress.current.ready >= total)


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
    also waits for the upload in flight; when training stops on an exception (a SIGTERM
    included: Lightning's, or taskpoint's ``on_preempt`` inside a task) the attempt ends
    once the upload in flight is done, or after ``preempt_timeout`` seconds.

    What each mirror cost is logged to the Trainer's loggers (``trainer.loggers``) at the
    next hook after it committed: ``taskpoint/blocked_s`` (how long training waited),
    ``taskpoint/upload_s``, and where the checkpoint reports them (a
    :class:`taskpoint.Checkpoint` does) ``taskpoint/uploaded_bytes`` and
    ``taskpoint/stored_bytes``.
    Saves from ``every_n_train_steps`` (mid-epoch), ``every_n_epochs``,
    ``train_time_interval``, validation and ``save_on_exception`` are all mirrored. Writes
    queued by Lightning's ``AsyncCheckpointIO`` are waited for first.

    The callback also keeps the global random state (Python, NumPy, torch, and CUDA when
    training on it; every rank's) in the checkpoint and restores it when Lightning loads
    the checkpoint, so a resumed run draws the same dropout masks and shuffles as an
    uninterrupted one. Mid-epoch resumes are exact when the dataloader is resumable
    (implements ``state_dict``/``load_state_dict``, as torchdata's
    ``StatefulDataLoader`` does).

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
            flight; ``None`` waits as long as it takes.
        timeout: with several processes, how many seconds a rank waits for the others at
            each step of a mirror (the uploads included).
        **kwargs: ``ModelCheckpoint``'s keyword arguments: ``dirpath``, ``filename``,
            ``monitor``, ``save_last`` (``True`` or ``"link"``), ``save_top_k``,
            ``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``, ...

    Raises:
        TypeError: ``checkpoint`` is not checkpoint-like (``None`` included).
        ValueError: ``preempt_timeout`` is negative, ``timeout`` not positive; at setup,
            ``dirpath`` is not a local folder.
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

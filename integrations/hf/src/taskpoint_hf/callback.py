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
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import taskpoint
from taskpoint import CheckpointLike, nodes
from taskpoint.coordination import check_timeout
from taskpoint.mirror import FolderMirror, combined_metrics, unshare
from taskpoint.torch_coordination import TorchCoordinator
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from taskpoint_hf import _distributed
from taskpoint_hf.resume import _scan, _step

__all__ = ["TaskpointTrainerCallback"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Nodes:
    """A multi-process job's coordinators (one per thread) and its disks."""

    main: TorchCoordinator
    uploads: TorchCoordinator
    disks: nodes.Disks


def _written_dir(args: TrainingArguments) -> Path:
    if args.output_dir is None:
        raise ValueError(
            "TrainingArguments.output_dir is None: set it, the Trainer writes checkpoint-N there"
        )
    return Path(os.fspath(args.output_dir))


def _calling_handler(callback: TrainerCallback) -> CallbackHandler | None:
    """The Trainer's ``CallbackHandler`` that is calling ``callback``'s hook now, if any."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and any(c is callback for c in owner.callbacks):
            return owner
    return None


class _FiguresIntoLogs:
    """Stands in for a ``CallbackHandler``'s ``on_log``: adds the callback's figures to the
    logs before the handler hands them to any callback.

    The Trainer appends its copy of the logs to ``state.log_history`` before calling
    ``on_log``, so the figures reach every callback (the ``report_to`` integrations, the
    console) and never the training history.
    """

    def __init__(self, callback: TaskpointTrainerCallback, handler: CallbackHandler) -> None:
        self.callback = callback
        self.handler = handler
        self.original = handler.on_log

    def __call__(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float],
        **kwargs: Any,
    ) -> TrainerControl:
        if logs is not None and any(c is self.callback for c in self.handler.callbacks):
            self.callback._add_figures(state, control, logs)
        return self.original(args, state, control, logs, **kwargs)  # type: ignore[no-any-return]


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
    ranks find out which of them share ``output_dir`` (a token file each); at each save,
    once every rank has written its files (its RNG state, sharded strategies their
    shards), the first rank of each disk stages that disk's files, a later disk adding
    only what the first lacks (its ranks' ``rng_state_<rank>.pth``, its shards), so a
    shared disk is uploaded once; then every rank commits its part with
    :meth:`taskpoint.Checkpoint.save_part_sync` over a gloo group of its own. A failure on
    any rank fails the save on every rank, and a rank that never arrives fails the others
    after ``timeout`` seconds. With another system's checkpoint, world process zero saves
    its own ``output_dir`` alone (as before multi-writer checkpoints).

    By default the upload runs in the background: world process zero takes a snapshot of
    ``output_dir`` (hard links where the disk allows, a copy otherwise; the Trainer never
    rewrites a finished ``checkpoint-N``), starts uploading it and returns, and every rank
    trains on. At most one upload is in flight: a save while the previous upload still runs
    waits for it first. An upload that failed raises its error at the next ``on_save`` or
    at ``on_train_end``, which also waits for the upload in flight. On SIGTERM inside a
    taskpoint task (``taskpoint.ctx().on_preempt``) the attempt ends once the upload in
    flight is done, or after ``preempt_timeout`` seconds. The Trainer has no hook for an
    exception out of training: an upload still in flight then finishes in the background,
    and :func:`~taskpoint_hf.restore_last_checkpoint` (a retry in the same process) or the
    interpreter's exit (for up to a minute) waits for it. Where an orchestrator collects
    the attempt's checkpoint as soon as the task function returns (Flyte's local retries
    copy it then), call :meth:`wait` in a ``finally`` around ``trainer.train()``.

    A just-in-time checkpoint (``enable_jit_checkpoint``), which the Trainer writes on
    SIGTERM without calling ``on_save``, is uploaded in ``on_train_end``.

    Each save's cost reaches every callback's ``on_log`` (the ``report_to`` integrations
    such as TensorBoard and W&B, which the Trainer lists first, the console, your own
    callbacks) with the next logs after its upload committed, but never
    ``state.log_history``: the Trainer's record of training (and so ``trainer_state.json``
    and a resumed run's history) is exactly what it would be without this callback. At
    training start the callback hooks the ``on_log`` of the Trainer's ``CallbackHandler``
    calling it, which the Trainer calls once it has recorded its own copy of the logs; the
    hook adds the figures before any callback sees them. The Trainer's last logs (after
    the last save) wait for that save's upload, so its figures come with them; a save
    later still (a just-in-time checkpoint, or the rotation below) is logged by one more
    ``on_log`` at ``on_train_end``. The figures: ``taskpoint/blocked_s`` (how long
    training waited), ``taskpoint/upload_s``, ``taskpoint/uploaded_bytes``,
    ``taskpoint/stored_bytes`` (the last two where the checkpoint reports them, as
    :class:`taskpoint.Checkpoint` does) and ``taskpoint/saves`` (how many saves the figures
    add up). Called by anything but a ``CallbackHandler``, the callback adds them to the
    ``logs`` its own ``on_log`` gets.

    The store ends holding what the Trainer kept: when the Trainer deletes checkpoints
    after its last save (``save_total_limit=1`` with ``load_best_model_at_end``),
    ``on_train_end`` saves the folder again. A resumed run writes an existing
    ``checkpoint-N`` again, in place: if an upload's snapshot still shares that folder's
    files, they get copies of their own first (at ``on_step_end``, ``on_epoch_end`` and
    ``on_evaluate``), so the upload commits them as they were at its save.

    Resume with :func:`~taskpoint_hf.restore_last_checkpoint`.

    Args:
        checkpoint: where to save (a :class:`taskpoint.Checkpoint`, or any
            :class:`~taskpoint.CheckpointLike` such as Flyte's checkpoint).
        output_dir: the Trainer's ``output_dir``; ``None`` takes ``args.output_dir`` when
            training begins.
        blocking: upload inside ``on_save``, every rank waiting until it has committed
            (the behaviour before background uploads). ``None`` (the default): in the
            background for a :class:`taskpoint.Checkpoint`, whose task waits for it; blocking
            for another system's checkpoint (Flyte's), whose attempt may end and hand its
            checkpoint on before a background upload lands.
        preempt_timeout: how many seconds a SIGTERM waits for the upload in flight;
            ``None`` waits as long as it takes.
        timeout: in a distributed job, how many seconds a rank waits for the others at
            each step of a save (the uploads included).

    Raises:
        TypeError: ``checkpoint`` lacks the checkpoint methods, or ``output_dir`` is not a
            path.
        ValueError: ``preempt_timeout`` is negative, or ``timeout`` not positive.
    """

    def __init__(
        self,
        checkpoint: CheckpointLike,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        blocking: bool | None = None,
        preempt_timeout: float | None = 60.0,
        timeout: float = 600.0,
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
        self._timeout = check_timeout(timeout)
        self._nodes: _Nodes | None = None
        self._checkpoint = checkpoint
        self._output_dir = Path(os.fspath(output_dir)) if output_dir is not None else None
        self._mirrored_step: int | None = None
        self._mirrored_names: frozenset[str] | None = None  # its checkpoint-N folders
        self._handler: weakref.ref[CallbackHandler] | None = None  # the one hooked
        self._deferred: BaseException | None = None  # an upload error met while logging
        self._uploads = FolderMirror(checkpoint, blocking=blocking)
        self._preempt_timeout = preempt_timeout
        self._preempt_contexts: list[taskpoint.TaskContext] = []

    def __repr__(self) -> str:
        return (
            f"TaskpointTrainerCallback({self._checkpoint!r}, output_dir={self._output_dir!r}, "
            f"blocking={self._uploads.blocking})"
        )

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
        return self._uploads.wait(timeout)

    def _folder(self, args: TrainingArguments) -> Path:
        if self._output_dir is None:
            self._output_dir = _written_dir(args)
        return self._output_dir

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Check that the Trainer writes inside the mirrored directory.

        Raises:
            ValueError: ``args.output_dir`` is neither the callback's ``output_dir`` nor
                inside it, so its checkpoints would never be saved.
        """
        folder = self._folder(args)
        written = Path(os.path.abspath(_written_dir(args)))
        mirrored = Path(os.path.abspath(folder))
        if written != mirrored and mirrored not in written.parents:
            raise ValueError(
                f"TaskpointTrainerCallback mirrors {str(folder)!r} but the Trainer writes its "
                f"checkpoints to output_dir={str(args.output_dir)!r}; pass the same "
                "directory (or output_dir=None to follow the TrainingArguments)"
            )
        newest = _scan(folder).complete
        self._mirrored_step = _step(newest[-1]) if newest else None
        self._mirrored_names = frozenset(p.name for p in newest)
        self._hook_logs()
        self._nodes = self._nodes or self._find_nodes(folder)
        if state.is_world_process_zero:
            self._wait_on_preempt()
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

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Save ``output_dir`` once every rank has finished writing ``checkpoint-N``.

        Raises:
            taskpoint.CheckpointError: the previous background upload failed (on world
                process zero; the store keeps the checkpoint before it).
        """
        self._mirror(args, state, state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unshare ``checkpoint-N`` if the Trainer is about to write it again."""
        self._unshare_next(args, state)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unshare ``checkpoint-N`` if the Trainer is about to write it again."""
        self._unshare_next(args, state)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Unshare ``checkpoint-N`` if the Trainer is about to write it again
        (``save_strategy="best"`` decides to save only after evaluating)."""
        self._unshare_next(args, state)

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
        if logs is not None and self._hooked() is None:
            self._add_figures(state, control, logs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Upload a newer complete checkpoint that no ``on_save`` announced (a JIT one), and
        wait for the upload in flight.

        Raises:
            taskpoint.CheckpointError: an upload failed (on world process zero).
        """
        newest = _scan(self._folder(args)).complete if state.is_world_process_zero else []
        step = _step(newest[-1]) if newest else None
        behind = step is not None and (self._mirrored_step is None or step > self._mirrored_step)
        if state.is_world_process_zero and self._mirrored_names is not None:
            # the Trainer's end-of-training rotation (save_total_limit=1 with a best
            # checkpoint) deletes checkpoints after the last on_save: the store follows
            behind = behind or frozenset(p.name for p in newest) != self._mirrored_names
        if any(_distributed.all_gather_object(behind)):
            self._mirror(args, state, step)
        if self._nodes is not None:  # every rank takes part in the upload
            nodes.run_everywhere(self._nodes.main, self._wait, "finish the last upload")
        elif state.is_world_process_zero:
            self._wait()
        if state.is_world_process_zero:
            metrics = self._take_metrics()
            handler = self._hooked()
            if metrics and handler is not None:  # a save after the Trainer's last log
                handler.call_event(  # type: ignore[no-untyped-call]
                    "on_log", args, state, control, logs=metrics
                )
            elif metrics:
                log.info("taskpoint figures at the end of training: %s", metrics)

    def _find_nodes(self, folder: Path) -> _Nodes | None:
        """In a multi-process job saving to a taskpoint.Checkpoint: the coordinators and
        which ranks share a disk (collectives: every rank calls this once)."""
        ranks = _distributed.current_ranks()
        if ranks.world_size < 2 or not ranks.grouped:
            return None
        if not isinstance(self._checkpoint, taskpoint.Checkpoint):
            if ranks.rank == 0:
                log.warning(
                    "%r is not a taskpoint.Checkpoint: only world process zero's output_dir "
                    "is saved (other nodes' own files, such as their RNG states, are not)",
                    self._checkpoint,
                )
            return None
        main = TorchCoordinator(timeout=self._timeout)
        uploads = TorchCoordinator(timeout=self._timeout)  # used by the upload thread only
        disks = nodes.find_disks(main, folder)
        if disks.leads(main.rank):
            nodes.discard_stale_parts(folder)
        log.info(
            "rank %d: %d process(es) write %s on %d disk(s)",
            main.rank, main.world_size, folder, disks.count,
        )
        return _Nodes(main, uploads, disks)

    def _mirror(self, args: TrainingArguments, state: TrainerState, step: int | None) -> None:
        _distributed.barrier()  # every rank has written its files into checkpoint-N
        if self._nodes is not None:
            self._mirror_parts(args, self._nodes, step)
            return
        if not self._uploads.blocking:
            if state.is_world_process_zero:
                self._save(args, step)
            return
        try:
            if state.is_world_process_zero:
                self._save(args, step)
        finally:
            _distributed.barrier()  # nobody writes the next checkpoint during the upload

    def _mirror_parts(self, args: TrainingArguments, ranks: _Nodes, step: int | None) -> None:
        folder = self._folder(args)
        nodes.run_everywhere(  # the previous upload's error, on whichever rank, everywhere
            ranks.main, self._uploads.wait, "finish the previous upload"
        )
        part = nodes.stage_part(ranks.main, folder, ranks.disks)
        if ranks.main.rank == 0:
            log.info("saving %s (step %s) to %r from every node", folder, step, self._checkpoint)
        self._uploads.save_part(
            part, coordinator=ranks.uploads, step=step, remove=part.parent
        )
        self._mirrored_step = step
        self._mirrored_names = frozenset(p.name for p in _scan(folder).complete)

    def _save(self, args: TrainingArguments, step: int | None) -> None:
        folder = self._folder(args)
        log.info("saving %s (step %s) to %r", folder, step, self._checkpoint)
        self._raise_deferred()
        self._uploads.save(folder, step=step)
        self._mirrored_step = step
        self._mirrored_names = frozenset(p.name for p in _scan(folder).complete)

    def _take_metrics(self) -> dict[str, float]:
        return combined_metrics(self._uploads.take_stats())

    def _hook_logs(self) -> None:
        """Hook the ``on_log`` of the Trainer's callback handler calling this hook (once per
        handler), so the figures reach the callbacks listed before this one too."""
        handler = _calling_handler(self)
        if handler is None:
            return
        current = handler.on_log
        if not (isinstance(current, _FiguresIntoLogs) and current.callback is self):
            handler.on_log = _FiguresIntoLogs(self, handler)  # type: ignore[method-assign]
        self._handler = weakref.ref(handler)

    def _hooked(self) -> CallbackHandler | None:
        """The handler whose ``on_log`` adds this callback's figures, while it holds it."""
        handler = self._handler() if self._handler is not None else None
        if handler is None or not any(c is self for c in handler.callbacks):
            return None
        return handler

    def _add_figures(
        self, state: TrainerState, control: TrainerControl, logs: dict[str, float]
    ) -> None:
        """Add the figures of the saves committed since the last log to ``logs``. At the
        Trainer's last logs (training stops, this step's checkpoint already saved) the
        upload in flight is waited for first, so the last save's figures are logged too;
        its error is raised at ``on_train_end``."""
        if not state.is_world_process_zero:
            return
        if (
            control.should_training_stop
            and self._mirrored_step == state.global_step
            and self._nodes is None
            and self._deferred is None
        ):
            try:
                self._uploads.wait()
            except BaseException as exc:  # raised where it always was, at on_train_end
                self._deferred = exc
        logs.update(self._take_metrics())

    def _raise_deferred(self) -> None:
        error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    def _wait(self) -> None:
        self._raise_deferred()
        self._uploads.wait()

    def _unshare_next(self, args: TrainingArguments, state: TrainerState) -> None:
        """Before the Trainer may write ``checkpoint-N`` of the current step, give its files
        their own copies if an upload's snapshot still shares them: a resumed run writes an
        existing ``checkpoint-N`` again, in place."""
        if not self._uploads.uploading:
            return
        target = _written_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        copied = unshare(target)
        if copied:
            log.info(
                "%s is about to be written again while an upload reads it: gave %d file(s) "
                "their own copy", target, copied,
            )

    def _wait_on_preempt(self) -> None:
        """Inside a taskpoint task, make SIGTERM wait for the upload in flight (once per
        task context)."""
        context = taskpoint.ctx()
        if context is None or any(c is context for c in self._preempt_contexts):
            return
        self._preempt_contexts.append(context)
        context.on_preempt(self._on_preempt)

    def _on_preempt(self) -> None:
        try:
            if not self._uploads.wait(self._preempt_timeout):
                log.warning(
                    "SIGTERM: the upload to %r still runs after %ss; ending the attempt "
                    "without it (the store keeps the checkpoint before)",
                    self._checkpoint, self._preempt_timeout,
                )
        except Exception as exc:  # the attempt ends with Preempted either way
            log.warning("SIGTERM: the upload to %r failed: %s", self._checkpoint, exc)

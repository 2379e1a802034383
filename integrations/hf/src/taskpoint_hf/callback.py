"""``TaskpointTrainerCallback``: mirror the Trainer's ``output_dir`` after every save.

Example::

    import taskpoint
    from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint

    ckpt = taskpoint.ctx().checkpoint
    args = TrainingArguments(output_dir="out", save_strategy="epoch", save_total_limit=2)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[TaskpointTrainerCallback(ckpt, args.output_dir)])
    trainer.train(resume_from_checkpoint=restore_last_checkpoint(ckpt, args))
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from taskpoint import CheckpointLike
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from taskpoint_hf import _distributed
from taskpoint_hf.resume import _scan, _step

__all__ = ["TaskpointTrainerCallback"]

log = logging.getLogger(__name__)


def _written_dir(args: TrainingArguments) -> Path:
    if args.output_dir is None:
        raise ValueError(
            "TrainingArguments.output_dir is None: set it, the Trainer writes checkpoint-N there"
        )
    return Path(os.fspath(args.output_dir))


class TaskpointTrainerCallback(TrainerCallback):
    """Save the Trainer's ``output_dir`` to a taskpoint checkpoint after each ``checkpoint-N``.

    The upload happens in ``on_save``, which the Trainer (and TRL's trainers built on it,
    such as ``SFTTrainer``) calls once ``checkpoint-N`` is completely written and the
    ``save_total_limit`` rotation has deleted old ones, so the store holds exactly the
    checkpoints the Trainer kept. In a distributed job every rank first waits until all
    ranks have written their part (each writes its own RNG state, sharded strategies their
    shards), then only world process zero uploads. Works with ``save_strategy`` ``"steps"``
    and ``"epoch"``, full models and PEFT adapters alike.

    A just-in-time checkpoint (``enable_jit_checkpoint``), which the Trainer writes on
    SIGTERM without calling ``on_save``, is uploaded in ``on_train_end``.

    Resume with :func:`~taskpoint_hf.restore_last_checkpoint`.

    Args:
        checkpoint: where to save (a :class:`taskpoint.Checkpoint`, or any
            :class:`~taskpoint.CheckpointLike` such as Flyte's checkpoint).
        output_dir: the Trainer's ``output_dir``; ``None`` takes ``args.output_dir`` when
            training begins.

    Raises:
        TypeError: ``checkpoint`` lacks the checkpoint methods, or ``output_dir`` is not a
            path.
    """

    def __init__(
        self, checkpoint: CheckpointLike, output_dir: str | os.PathLike[str] | None = None
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
        self._checkpoint = checkpoint
        self._output_dir = Path(os.fspath(output_dir)) if output_dir is not None else None
        self._mirrored_step: int | None = None

    def __repr__(self) -> str:
        return f"TaskpointTrainerCallback({self._checkpoint!r}, output_dir={self._output_dir!r})"

    @property
    def output_dir(self) -> Path | None:
        """The directory mirrored (``None`` until training begins when none was given)."""
        return self._output_dir

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
        """Upload ``output_dir`` once every rank has finished writing ``checkpoint-N``."""
        self._mirror(args, state, state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Upload a newer complete checkpoint that no ``on_save`` announced (a JIT one)."""
        newest = _scan(self._folder(args)).complete if state.is_world_process_zero else []
        step = _step(newest[-1]) if newest else None
        behind = step is not None and (self._mirrored_step is None or step > self._mirrored_step)
        if any(_distributed.all_gather_object(behind)):
            self._mirror(args, state, step)

    def _mirror(self, args: TrainingArguments, state: TrainerState, step: int | None) -> None:
        _distributed.barrier()  # every rank has written its files into checkpoint-N
        try:
            if state.is_world_process_zero:
                folder = self._folder(args)
                log.info("saving %s (step %s) to %r", folder, step, self._checkpoint)
                self._checkpoint.save_sync(folder)
                self._mirrored_step = step
        finally:
            _distributed.barrier()  # nobody writes the next checkpoint during the upload

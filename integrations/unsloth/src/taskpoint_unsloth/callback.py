"""``TaskpointUnslothCallback``: the Hugging Face callback, plus the LoRA config in each
checkpoint (the package docstring shows how)."""

from __future__ import annotations

import logging
from typing import Any

from taskpoint_hf import TaskpointTrainerCallback, last_complete_checkpoint
from transformers import TrainerControl, TrainerState, TrainingArguments

from taskpoint_unsloth.lora import LORA_RECORD, write_lora_record

__all__ = ["TaskpointUnslothCallback"]

log = logging.getLogger(__name__)


class TaskpointUnslothCallback(TaskpointTrainerCallback):
    """Save the Trainer's ``output_dir`` after each ``checkpoint-N``, with its LoRA config.

    Everything :class:`taskpoint_hf.TaskpointTrainerCallback` does, and before each upload
    it writes the model's LoRA config and base-model identity
    (:class:`~taskpoint_unsloth.LoraSignature`) to ``checkpoint-N/taskpoint-lora.json``,
    which :func:`~taskpoint_unsloth.restore_lora_checkpoint` checks on resume. With a PEFT
    model the Trainer's ``checkpoint-N`` holds the adapter weights, optimizer, scheduler,
    RNG and Trainer state, never the base model.

    Args:
        checkpoint: where to save (any :class:`~taskpoint.CheckpointLike`).
        output_dir: the Trainer's ``output_dir``; ``None`` takes ``args.output_dir``.
    """

    def _record(self, args: TrainingArguments, state: TrainerState, model: Any) -> None:
        if not state.is_world_process_zero or model is None:
            return
        newest = last_complete_checkpoint(self._folder(args))
        if newest is None or (newest / LORA_RECORD).exists():
            return
        try:
            write_lora_record(newest, model)
        except TypeError:
            log.warning(
                "%s: the model has no LoRA adapters, so no LoRA config is recorded", newest
            )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Record the LoRA config in the new ``checkpoint-N``, then upload ``output_dir``."""
        self._record(args, state, kwargs.get("model"))
        super().on_save(args, state, control, **kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Record and upload a newer complete checkpoint that no ``on_save`` announced."""
        self._record(args, state, kwargs.get("model"))
        super().on_train_end(args, state, control, **kwargs)

"""Restore the newest complete LoRA checkpoint and check it matches the rebuilt model (the
package docstring shows how)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from taskpoint import CheckpointLike
from taskpoint_hf import restore_last_checkpoint
from taskpoint_hf.resume import OutputDir

from taskpoint_unsloth.lora import check_lora_config

__all__ = ["restore_lora_checkpoint"]

log = logging.getLogger(__name__)


def restore_lora_checkpoint(
    checkpoint: CheckpointLike,
    output_dir: OutputDir,
    model: Any,
    *,
    ignore: Iterable[str] = (),
) -> Path | None:
    """Restore the Trainer's output directory and check its newest checkpoint against ``model``.

    Does what :func:`taskpoint_hf.restore_last_checkpoint` does, then compares the LoRA
    config and base model the restored ``checkpoint-N`` was trained with to ``model`` (see
    :func:`~taskpoint_unsloth.check_lora_config`), so a mismatch is refused before
    training starts instead of failing (or silently training something else) inside
    ``trainer.train``.

    Args:
        checkpoint: where :class:`~taskpoint_unsloth.TaskpointUnslothCallback` saved.
        output_dir: the Trainer's ``output_dir``, or its ``TrainingArguments``.
        model: the freshly built PEFT model (after ``FastLanguageModel.get_peft_model``).
        ignore: :class:`~taskpoint_unsloth.LoraSignature` fields not to compare.

    Returns:
        The ``checkpoint-N`` to pass to ``trainer.train(resume_from_checkpoint=...)``, or
        ``None`` when nothing was saved yet.

    Raises:
        LoraConfigMismatchError: the checkpoint was trained with another LoRA config or
            base model; the message names each difference.
        CheckpointError: as :func:`taskpoint_hf.restore_last_checkpoint`.
        TypeError: ``model`` has no LoRA adapters.
    """
    path = restore_last_checkpoint(checkpoint, output_dir)
    if path is not None:
        check_lora_config(path, model, ignore=ignore)
        log.info("LoRA config of %s matches the model", path)
    return path

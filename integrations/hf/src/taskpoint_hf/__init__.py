"""taskpoint-hf: Hugging Face ``Trainer`` (and TRL ``SFTTrainer``) checkpoints that survive retries.

:class:`TaskpointTrainerCallback` saves the Trainer's ``output_dir`` to a taskpoint
checkpoint after every ``checkpoint-N`` the Trainer writes; :func:`restore_last_checkpoint`
brings it back on the next attempt and returns the newest complete ``checkpoint-N`` for
``trainer.train(resume_from_checkpoint=...)``::

    import taskpoint
    from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint
    from transformers import Trainer, TrainingArguments

    env = taskpoint.TaskEnvironment(name="finetune")

    @env.task(retries=3)
    def train() -> None:
        ckpt = taskpoint.ctx().checkpoint
        args = TrainingArguments(output_dir="out", save_strategy="steps", save_steps=100,
                                 save_total_limit=2)
        resume = restore_last_checkpoint(ckpt, args)     # None on the first attempt
        trainer = Trainer(model=make_model(), args=args, train_dataset=make_data(),
                          callbacks=[TaskpointTrainerCallback(ckpt, args.output_dir)])
        trainer.train(resume_from_checkpoint=resume)

The same two objects work unchanged with ``trl.SFTTrainer``, PEFT (LoRA) models and
``torchrun``. Inside a task, SIGTERM becomes the Trainer's own ``checkpoint-N`` at the next
step boundary, and ``trainer.train()`` raises :class:`taskpoint.Preempted`.
"""

from taskpoint import require_version

SUPPORTED_TRANSFORMERS = ">=4.46,<6"
"""The transformers releases this adapter supports (PEP 440 specifier); importing the
package raises ``ImportError`` outside them."""

require_version(f"transformers{SUPPORTED_TRANSFORMERS}", adapter="taskpoint-hf")

from taskpoint_hf.callback import TaskpointTrainerCallback  # noqa: E402
from taskpoint_hf.resume import (  # noqa: E402
    INCOMPLETE_MARKER,
    TRAINER_STATE,
    checkpoint_step,
    last_complete_checkpoint,
    restore_last_checkpoint,
)

__version__ = "0.1.0"

__all__ = [
    "INCOMPLETE_MARKER",
    "SUPPORTED_TRANSFORMERS",
    "TRAINER_STATE",
    "TaskpointTrainerCallback",
    "__version__",
    "checkpoint_step",
    "last_complete_checkpoint",
    "restore_last_checkpoint",
]

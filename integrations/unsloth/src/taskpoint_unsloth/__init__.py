"""taskpoint-unsloth: Unsloth LoRA fine-tuning (``SFTTrainer``) that resumes after a retry.

Built on :mod:`taskpoint_hf`: :class:`TaskpointUnslothCallback` uploads the Trainer's
``output_dir`` after every ``checkpoint-N`` (adapter weights, optimizer, scheduler and
Trainer state; never the base model) together with the LoRA config it was trained with;
:func:`restore_lora_checkpoint` brings it back on the next attempt and refuses it, naming
the difference, when the rebuilt model's LoRA config or base model differs::

    import taskpoint
    from taskpoint_unsloth import TaskpointUnslothCallback, restore_lora_checkpoint
    from unsloth import FastLanguageModel
    from trl import SFTConfig, SFTTrainer

    env = taskpoint.TaskEnvironment(name="lora")

    @env.task(retries=3)
    def train() -> None:
        ckpt = taskpoint.ctx().checkpoint
        model, tokenizer = FastLanguageModel.from_pretrained(MODEL, load_in_4bit=True)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16,
                                                 target_modules=["q_proj", "v_proj"])
        args = SFTConfig(output_dir="out", save_steps=50, save_total_limit=2)
        resume = restore_lora_checkpoint(ckpt, args, model)   # None on the first attempt
        trainer = SFTTrainer(model=model, args=args, train_dataset=data,
                             processing_class=tokenizer,
                             callbacks=[TaskpointUnslothCallback(ckpt, args.output_dir)])
        trainer.train(resume_from_checkpoint=resume)

Importing this package imports Unsloth first, so its patches precede transformers.
"""

from taskpoint import require_version

SUPPORTED_UNSLOTH = ">=2026.10"
"""The Unsloth releases this adapter supports (PEP 440 specifier): the first with CPU
training on. Importing the package raises ``ImportError`` outside them."""

require_version(f"unsloth{SUPPORTED_UNSLOTH}", adapter="taskpoint-unsloth")

import unsloth  # noqa: E402, F401  (before transformers, as Unsloth requires)

from taskpoint_unsloth.callback import TaskpointUnslothCallback  # noqa: E402
from taskpoint_unsloth.lora import (  # noqa: E402
    ADAPTER_CONFIG,
    LORA_RECORD,
    LoraConfigMismatchError,
    LoraSignature,
    base_config_hash,
    check_lora_config,
    lora_signature,
    read_lora_record,
    write_lora_record,
)
from taskpoint_unsloth.resume import restore_lora_checkpoint  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ADAPTER_CONFIG",
    "LORA_RECORD",
    "SUPPORTED_UNSLOTH",
    "LoraConfigMismatchError",
    "LoraSignature",
    "TaskpointUnslothCallback",
    "__version__",
    "base_config_hash",
    "check_lora_config",
    "lora_signature",
    "read_lora_record",
    "restore_lora_checkpoint",
    "write_lora_record",
]

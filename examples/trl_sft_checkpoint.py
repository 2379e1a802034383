"""LoRA fine-tuning of a tiny causal LM with TRL's ``SFTTrainer``; fail on purpose, resume.

Run it::

    uv run python examples/trl_sft_checkpoint.py

``SFTTrainer`` is a ``transformers.Trainer``, so the same ``TaskpointTrainerCallback`` and
``restore_last_checkpoint`` work unchanged: the Trainer saves a ``checkpoint-N`` holding
the LoRA adapter (through PEFT), the optimizer and the RNG states every few steps, the
callback saves the output directory to the task's checkpoint, and each retry resumes from
the newest complete one. Attempts 0 and 1 fail on purpose; the result equals an
uninterrupted run's to the last bit, which the example runs to show it.

Nothing is downloaded: the tokenizer is trained on the lines below and the Llama-style
model is built from a config. Checkpoints go to the embedded local store,
``./.taskpoint/checkpoints``, unless ``TASKPOINT_ROOT`` names another location.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import datasets
import taskpoint
import torch
import transformers
from datasets import Dataset
from peft import LoraConfig
from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    PrinterCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from trl import SFTConfig, SFTTrainer

datasets.disable_progress_bars()
# TRL passes transformers a few arguments that transformers has renamed; not our concern here.
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
transformers.logging.disable_progress_bar()

env = taskpoint.TaskEnvironment(name="checkpoint_trl_sft")

RETRIES = 2
OUTPUT_ROOT = Path(".taskpoint") / "outputs"
LINES = [
    "question what is two plus two answer four",
    "question what colour is the sky answer blue",
    "question what do cats say answer meow",
    "question how many legs has a spider answer eight",
    "question what is the opposite of hot answer cold",
    "question what do bees make answer honey",
    "question how many days has a week answer seven",
    "question what falls from clouds answer rain",
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on LINES, so nothing is downloaded."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", tok.token_to_id("[BOS]"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
        eos_token="[EOS]",
    )


def tiny_instruction_dataset() -> Dataset:
    return Dataset.from_dict({"text": LINES * 2})


class SimulatedFailure(TrainerCallback):
    """Raise at ``step``, so the next attempt has something to resume from."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step == self.step:
            print(f"  simulated failure at step {self.step}", flush=True)
            raise RuntimeError(f"Simulated failure at step {self.step}")


def train(
    output_dir: Path, checkpoint: taskpoint.CheckpointLike | None, fail_at: int | None
) -> float:
    tokenizer = make_tokenizer()
    args = SFTConfig(
        output_dir=str(output_dir),
        max_steps=20,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=4,
        save_total_limit=2,
        logging_steps=1,
        report_to="none",
        seed=42,
        use_cpu=True,
        disable_tqdm=True,
        dataset_text_field="text",
        max_length=16,
    )
    callbacks: list[TrainerCallback] = []
    resume = None
    if checkpoint is not None:
        # Restore the previous attempt's output_dir; the newest complete checkpoint-N, or None.
        resume = restore_last_checkpoint(checkpoint, args)
        callbacks.append(TaskpointTrainerCallback(checkpoint, args.output_dir))
    if fail_at is not None:
        callbacks.append(SimulatedFailure(fail_at))

    torch.manual_seed(0)  # the model's and the LoRA adapter's initial weights
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config),
        args=args,
        train_dataset=tiny_instruction_dataset(),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)  # keep the output to the lines below
    if checkpoint is not None:
        print(f"  resuming from: {resume.name if resume else 'nothing saved yet'}", flush=True)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    model = trainer.model
    model.eval()
    with torch.no_grad():
        batch = tokenizer("question what do bees make answer", return_tensors="pt")
        return float(model(**batch).logits[0, -1].max().item())


@env.task(retries=RETRIES, backoff=0.0)
def train_sft() -> float:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    print(f"attempt {context.attempt}:", flush=True)
    # Attempts 0 and 1 fail at steps 6 and 14; checkpoints are saved every 4 steps.
    fail_at = 6 + 8 * context.attempt if context.attempt < RETRIES else None
    return train(OUTPUT_ROOT / "trl_sft", context.checkpoint, fail_at)


if __name__ == "__main__":
    result = train_sft()
    print("uninterrupted run, for comparison:", flush=True)
    reference = train(OUTPUT_ROOT / "trl_sft_reference", None, None)
    print(f"resumed run:       {result!r}")
    print(f"uninterrupted run: {reference!r}")
    print(f"identical: {result == reference}")

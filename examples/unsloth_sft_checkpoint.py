"""LoRA fine-tuning with Unsloth and TRL's ``SFTTrainer``; fail on purpose, resume.

Run it (Unsloth has its own environment, see integrations/unsloth/README.md)::

    UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth python examples/unsloth_sft_checkpoint.py

The spec's flow: the task loads the base model with ``FastLanguageModel.from_pretrained``,
adds LoRA adapters with ``get_peft_model`` and trains with ``SFTTrainer``, which saves
``checkpoint-N`` every epoch; ``TaskpointUnslothCallback`` saves the output directory (the
LoRA adapter weights, optimizer, scheduler, RNG and Trainer state, never the base model)
to the task's checkpoint after each save. Attempts 0 and 1 fail on purpose mid-epoch; each
retry rebuilds the same model, and ``restore_lora_checkpoint`` restores the output directory,
checks that the checkpoint was trained with this LoRA config and base model, and returns
the newest complete ``checkpoint-N`` to resume from. The LoRA weights equal an uninterrupted
run's to the last bit; the example runs one to show it.

Unsloth 2026.10+ trains on CPU when there is no GPU, which this example uses; on a GPU
set ``load_in_4bit=True`` and ``use_gradient_checkpointing="unsloth"`` as in the spec.
Nothing is downloaded: a tiny Llama is built from a config, with a tokenizer trained on the
sentences below, and saved to disk as the "base model". Checkpoints go to the embedded local
store, ``./.taskpoint/checkpoints``, unless ``TASKPOINT_ROOT`` names another location.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import unsloth  # noqa: F401  (first: Unsloth patches transformers and TRL on import)
    from unsloth import FastLanguageModel
except ImportError as exc:
    sys.exit(
        f"this example needs Unsloth ({exc}); run it in Unsloth's environment:\n"
        "    UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth python examples/unsloth_sft_checkpoint.py"
    )

import datasets
import taskpoint
import torch
import transformers
from datasets import Dataset
from taskpoint_unsloth import TaskpointUnslothCallback, restore_lora_checkpoint
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

transformers.logging.disable_progress_bar()
datasets.disable_progress_bars()
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # bitwise-reproducible CPU math

env = taskpoint.TaskEnvironment(name="checkpoint_unsloth_sft")

RETRIES = 2
OUTPUT_ROOT = Path(".taskpoint") / "outputs"
BASE_MODEL = OUTPUT_ROOT / "tiny-llama"
SENTENCES = [
    "### instruction: greet ### response: hello there",
    "### instruction: count ### response: one two three",
    "### instruction: colour ### response: the sky is blue",
    "### instruction: animal ### response: the cat sat on the mat",
    "### instruction: weather ### response: it is sunny today",
    "### instruction: food ### response: bread and cheese",
]


def make_base_model(folder: Path) -> Path:
    """Save a tiny random Llama and a locally trained tokenizer: the "pretrained" model."""
    if (folder / "config.json").exists():
        return folder
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", tok.token_to_id("[BOS]"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
        eos_token="[EOS]",
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class SimulatedFailure(TrainerCallback):
    """Raise at ``step``, so the next attempt has something to resume from."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if state.global_step == self.step:
            print(f"  simulated failure at step {self.step} (epoch {state.epoch:g})", flush=True)
            raise RuntimeError(f"Simulated failure at step {self.step}")


def train(
    output_dir: Path, checkpoint: taskpoint.CheckpointLike | None, fail_at: int | None
) -> dict[str, torch.Tensor]:
    """Train LoRA adapters for 5 epochs (3 steps each); return the LoRA weights."""
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(make_base_model(BASE_MODEL)),
        max_seq_length=32,
        dtype=None,
        load_in_4bit=False,  # True on a GPU, as in the spec
        local_files_only=True,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        use_gradient_checkpointing=False,  # "unsloth" on a GPU
        random_state=42,
    )
    args = SFTConfig(
        output_dir=str(output_dir),
        num_train_epochs=5,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        save_strategy="epoch",
        save_total_limit=2,
        logging_steps=1,
        report_to="none",
        seed=42,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataset_text_field="text",
        max_length=32,
    )
    callbacks: list[TrainerCallback] = []
    resume = None
    if checkpoint is not None:
        # Restore the previous attempt's output_dir and check it was trained with this LoRA
        # config and base model (LoraConfigMismatchError otherwise); None on the first attempt.
        resume = restore_lora_checkpoint(checkpoint, args, model)
        callbacks.append(TaskpointUnslothCallback(checkpoint, args.output_dir))
        print(f"  resuming from: {resume.name if resume else 'nothing saved yet'}", flush=True)
    if fail_at is not None:
        callbacks.append(SimulatedFailure(fail_at))
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": SENTENCES}),
        processing_class=tokenizer, callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)  # keep the output to the lines above
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    print(f"  finished at step {trainer.state.global_step}", flush=True)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if "lora_" in k}


@env.task(retries=RETRIES, backoff=0.0)
def train_unsloth_sft() -> dict[str, torch.Tensor]:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    print(f"attempt {context.attempt}:", flush=True)
    # Attempts 0 and 1 fail five steps after where they start (mid-epoch: 3 steps an epoch).
    fail_at = 5 + 3 * context.attempt if context.attempt < RETRIES else None
    return train(OUTPUT_ROOT / "unsloth_sft", context.checkpoint, fail_at)


if __name__ == "__main__":
    resumed = train_unsloth_sft()
    print("uninterrupted run, for comparison:", flush=True)
    reference = train(OUTPUT_ROOT / "unsloth_sft_reference", None, None)
    same = resumed.keys() == reference.keys() and all(
        torch.equal(resumed[k], reference[k]) for k in reference
    )
    print(f"LoRA tensors compared: {len(reference)}; identical to the uninterrupted run: {same}")
    sys.exit(0 if same else 1)

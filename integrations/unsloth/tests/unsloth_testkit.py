"""Tiny, fully local Unsloth LoRA runs shared by the tests and their child processes.

Nothing is downloaded: :func:`make_base_model` builds a tiny Llama from a config with a
fixed seed and a word-level tokenizer trained on a few sentences, and saves both to a
directory that Unsloth's ``FastLanguageModel.from_pretrained(..., local_files_only=True)``
loads. :func:`run_unsloth_sft` trains LoRA adapters on it with TRL's ``SFTTrainer`` and
can stop on purpose at a chosen step (an exception, or the process dying as if killed).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import unsloth  # noqa: F401  (first, before transformers)
from taskpoint import CheckpointLike
from taskpoint_unsloth import TaskpointUnslothCallback, restore_lora_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "good movie with great fun",
    "bad film with an awful plot",
    "i love this little song",
    "i hate that noisy road",
    "the weather is nice today",
    "the food was cold and terrible",
]
KILLED_EXIT = 137
TARGETS = ("q_proj", "v_proj")


class Interrupt(RuntimeError):
    """The failure a run raises on purpose."""


def make_base_model(folder: Path, *, hidden_size: int = 16, seed: int = 0) -> Path:
    """Save a tiny random Llama and its locally trained tokenizer to ``folder``."""
    special = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", tok.token_to_id("[BOS]"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
        bos_token="[BOS]", eos_token="[EOS]",
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=32, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_lora_model(
    base: Path,
    *,
    r: int = 4,
    lora_alpha: int = 8,
    target_modules: Sequence[str] = TARGETS,
    load_in_4bit: bool = False,
    gradient_checkpointing: bool | str = False,
    lora_dropout: float = 0.0,
) -> tuple[Any, Any]:
    """Load ``base`` with Unsloth (no downloads) and add LoRA adapters."""
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        str(base), max_seq_length=32, dtype=None, load_in_4bit=load_in_4bit,
        local_files_only=True,
    )
    model = FastLanguageModel.get_peft_model(
        model, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        target_modules=list(target_modules), bias="none", random_state=42,
        use_gradient_checkpointing=gradient_checkpointing,
    )
    return model, tokenizer


class StopAt(TrainerCallback):
    """Stop the run at ``step`` (``on_step_end``): raise :class:`Interrupt`, or die like a
    killed process.

    A process that dies calls ``settle`` first (the taskpoint callback's ``wait``, set by
    :func:`run_unsloth_sft`): the death then comes after the last save committed, whatever the
    machine's load, and the retry must resume from exactly that save. How soon a background
    upload commits is the preemption bench's measure, not this one's.
    """

    def __init__(self, step: int, *, how: str = "raise") -> None:
        self.step, self.how = step, how
        self.settle: Callable[[], object] | None = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step != self.step:
            return
        if self.how == "exit":
            if self.settle is not None:
                self.settle()
            os._exit(KILLED_EXIT)
        raise Interrupt(f"simulated failure at step {state.global_step}")


@dataclass
class Result:
    """What a finished run is compared by."""

    global_step: int
    losses: list[tuple[int, float]]
    lora: dict[str, torch.Tensor]
    resumed_from: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step, "losses": self.losses, "lora": self.lora,
            "resumed_from": self.resumed_from, "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        return cls(
            data["global_step"], [tuple(x) for x in data["losses"]],  # type: ignore[misc]
            data["lora"], data["resumed_from"], data.get("extra", {}),
        )


def assert_same_run(got: Result, want: Result) -> None:
    """Same global step, same loss log, bitwise-equal LoRA weights."""
    assert got.global_step == want.global_step
    assert got.losses == want.losses
    assert got.lora.keys() == want.lora.keys()
    assert got.lora, "no LoRA weights were compared"
    different = [k for k in want.lora if not torch.equal(got.lora[k], want.lora[k])]
    assert not different, f"LoRA weights differ from the uninterrupted run: {different}"


def sft_args(out_dir: Path, **overrides: Any) -> Any:
    """The SFTConfig every CPU run uses (10 steps, a checkpoint every 3)."""
    from trl import SFTConfig

    options: dict[str, Any] = {
        "output_dir": str(out_dir),
        "max_steps": 10,
        "per_device_train_batch_size": 2,
        "save_strategy": "steps",
        "save_steps": 3,
        "save_total_limit": 2,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "report_to": "none",
        "seed": 42,
        "use_cpu": True,
        "disable_tqdm": True,
        "max_length": 16,
        "dataset_text_field": "text",
    }
    options.update(overrides)
    return SFTConfig(**options)


def run_unsloth_sft(
    checkpoint: CheckpointLike | None,
    out_dir: Path,
    base: Path,
    *,
    stop: StopAt | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    r: int = 4,
    model_options: dict[str, Any] | None = None,
    callback_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Result:
    """Train LoRA adapters on ``base`` with Unsloth + SFTTrainer, resuming from ``checkpoint``
    (``callback_options``: more arguments of the taskpoint callback)."""
    from datasets import Dataset
    from trl import SFTTrainer

    model, tokenizer = load_lora_model(base, r=r, **(model_options or {}))
    args = sft_args(out_dir, **overrides)
    resume = restore_lora_checkpoint(checkpoint, args, model) if checkpoint is not None else None
    extra: list[TrainerCallback] = [stop] if stop is not None else []
    if checkpoint is not None:
        callback = TaskpointUnslothCallback(checkpoint, args.output_dir, **(callback_options or {}))
        extra.append(callback)
        if stop is not None:
            stop.settle = callback.wait
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": SENTENCES * 2}),
        processing_class=tokenizer, callbacks=[*extra, *callbacks],
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    losses = [(int(h["step"]), float(h["loss"])) for h in trainer.state.log_history if "loss" in h]
    lora = {
        k: v.detach().float().cpu().clone()
        for k, v in trainer.model.state_dict().items()
        if "lora_" in k
    }
    return Result(trainer.state.global_step, losses, lora, str(resume) if resume else None)

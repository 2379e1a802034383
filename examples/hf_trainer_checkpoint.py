"""Fine-tune a tiny BERT classifier with ``transformers.Trainer``; fail on purpose, resume.

Run it::

    uv run python examples/hf_trainer_checkpoint.py

The Trainer saves ``checkpoint-N`` every epoch; ``TaskpointTrainerCallback`` saves the
output directory to the task's checkpoint after each save. Attempts 0 and 1 fail on purpose
in the middle of an epoch; each retry restores the output directory with
``restore_last_checkpoint`` and resumes the Trainer from the newest complete
``checkpoint-N``: weights, optimizer, scheduler, RNG states and the data order. The result
equals an uninterrupted run's to the last bit; the example runs one to show it.

Nothing is downloaded: the tokenizer is trained on the sentences below and the model is
built from a config. Checkpoints go to the embedded local store, ``./.taskpoint/checkpoints``,
unless ``TASKPOINT_ROOT`` names another location (``s3://bucket/prefix``, ``gs://...``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import taskpoint
import torch
import transformers
from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PreTrainedTokenizerFast,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

transformers.logging.disable_progress_bar()

env = taskpoint.TaskEnvironment(name="checkpoint_hf_trainer")

RETRIES = 2
OUTPUT_ROOT = Path(".taskpoint") / "outputs"
TEXTS = [
    ("a wonderful film with great acting", 1),
    ("the plot was dull and far too long", 0),
    ("i loved every minute of this movie", 1),
    ("a boring mess with awful dialogue", 0),
    ("great music and a lovely story", 1),
    ("the worst film i have seen this year", 0),
    ("funny warm and beautifully shot", 1),
    ("badly written and poorly acted", 0),
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on TEXTS, so nothing is downloaded."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator([t for t, _ in TEXTS], trainers.WordLevelTrainer(special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]",
    )


class ToyTextDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """TEXTS, twice over, tokenized to a fixed length."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        texts = [t for t, _ in TEXTS] * 2
        self.labels = [label for _, label in TEXTS] * 2
        self.enc = tokenizer(texts, padding="max_length", max_length=12, truncation=True)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "input_ids": torch.tensor(self.enc["input_ids"][i]),
            "attention_mask": torch.tensor(self.enc["attention_mask"][i]),
            "labels": self.labels[i],
        }


class SimulatedFailure(TrainerCallback):
    """Raise at ``step``, so the next attempt has something to resume from."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step == self.step:
            print(f"  simulated failure at step {self.step} (epoch {state.epoch:g})", flush=True)
            raise RuntimeError(f"Simulated failure at step {self.step}")


def train(
    output_dir: Path, checkpoint: taskpoint.CheckpointLike | None, fail_at: int | None
) -> float:
    tokenizer = make_tokenizer()
    args = TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=6,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        save_strategy="epoch",
        save_total_limit=2,
        logging_steps=1,
        report_to="none",
        seed=42,
        use_cpu=True,
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = []
    resume = None
    if checkpoint is not None:
        # Restore the previous attempt's output_dir; the newest complete checkpoint-N, or None.
        resume = restore_last_checkpoint(checkpoint, args)
        callbacks.append(TaskpointTrainerCallback(checkpoint, args.output_dir))
    if fail_at is not None:
        callbacks.append(SimulatedFailure(fail_at))

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2,
    )
    model = BertForSequenceClassification(config)
    trainer = Trainer(
        model=model, args=args, train_dataset=ToyTextDataset(tokenizer), callbacks=callbacks
    )
    trainer.remove_callback(PrinterCallback)  # keep the output to the lines below
    if checkpoint is not None:
        start = f"{resume.name}" if resume else "nothing saved yet"
        print(f"  resuming from: {start}", flush=True)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    model.eval()
    with torch.no_grad():
        batch = tokenizer("a lovely film with great music", return_tensors="pt")
        return float(model(**batch).logits[0, 1].item())


@env.task(retries=RETRIES, backoff=0.0)
def train_transformers() -> float:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    print(f"attempt {context.attempt}:", flush=True)
    # Attempts 0 and 1 fail six steps after where they start (mid-epoch: 4 steps an epoch).
    fail_at = 6 + 4 * context.attempt if context.attempt < RETRIES else None
    return train(OUTPUT_ROOT / "hf_trainer", context.checkpoint, fail_at)


if __name__ == "__main__":
    result = train_transformers()
    print("uninterrupted run, for comparison:", flush=True)
    reference = train(OUTPUT_ROOT / "hf_trainer_reference", None, None)
    print(f"resumed run:       {result!r}")
    print(f"uninterrupted run: {reference!r}")
    print(f"identical: {result == reference}")

"""Tiny, fully local training recipes shared by the tests and their child processes.

Nothing is downloaded: tokenizers are trained on a few sentences, models are built from
configs with a fixed seed. ``run_classifier`` trains a tiny BERT sequence classifier with
``transformers.Trainer``; ``run_sft`` trains LoRA adapters on a tiny Llama with
``trl.SFTTrainer``. Both can stop on purpose at a chosen step (an exception, or the whole
process dying as if killed) and both resume through taskpoint_hf.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from taskpoint import CheckpointLike
from taskpoint.format.history import AttemptRecord, read_attempts
from taskpoint.integration import settle_uploads
from taskpoint.store.store import Store
from taskpoint_hf import TaskpointTrainerCallback, checkpoint_step, restore_last_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
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


class Interrupt(RuntimeError):
    """The failure a run raises on purpose."""


def word_tokenizer(*, causal: bool) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on :data:`SENTENCES`."""
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[BOS]", "[EOS]"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=special))
    if causal:
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A", special_tokens=[("[BOS]", tok.token_to_id("[BOS]"))]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
            bos_token="[BOS]", eos_token="[EOS]",
        )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
        cls_token="[CLS]", sep_token="[SEP]",
    )


class ClassificationData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """:data:`SENTENCES` (four times over) labelled by parity of their index."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        texts = SENTENCES * 4
        self.enc = tokenizer(texts, padding="max_length", max_length=12, truncation=True)
        self.labels = [i % 2 for i in range(len(texts))]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "input_ids": torch.tensor(self.enc["input_ids"][i]),
            "attention_mask": torch.tensor(self.enc["attention_mask"][i]),
            "labels": self.labels[i],
        }


class StopAt(TrainerCallback):
    """Stop the run at ``step``: raise :class:`Interrupt`, or die like a killed process.

    ``event`` is ``"step_end"`` (before that step's save) or ``"save"`` (after
    ``checkpoint-<step>`` is written, before any later callback such as the upload).

    It first waits for the uploads still in flight, so the stop lands between two uploads
    (uploads run in the background; ``test_background`` stops a run during one), unless
    ``settle`` is false: then an upload may still run when it stops. ``how="kill"`` sends
    the process SIGKILL.
    """

    def __init__(
        self, step: int, *, how: str = "raise", event: str = "step_end", settle: bool = True
    ) -> None:
        self.step, self.how, self.event, self.settle = step, how, event, settle

    def _stop(self, state: TrainerState) -> None:
        if state.global_step != self.step:
            return
        if self.settle:
            settle_uploads()
        if self.how == "exit":
            os._exit(KILLED_EXIT)
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise Interrupt(f"simulated failure at step {state.global_step}")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.event == "step_end":
            self._stop(state)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.event == "save":
            self._stop(state)


class FailInForward(TrainerCallback):
    """Raise :class:`Interrupt` in the forward pass of the step after ``step`` (once
    ``state.global_step == step``), after the model's dropout layers have drawn their masks:
    at BERT's ``classifier`` or the Llama's final norm, in training mode."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._state: TrainerState | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._state = state
        model = kw["model"]
        head = next(m for n, m in model.named_modules() if n.endswith(("classifier", "model.norm")))
        head.register_forward_pre_hook(self._before_head)

    def _before_head(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and self._state is not None and self._state.global_step == self.step:
            raise Interrupt(f"simulated failure in the forward pass after step {self.step}")


class SignalAt(TrainerCallback):
    """Send this process ``signum`` at the end of step ``step`` (training goes on), then
    sleep ``pause`` seconds there; ``then`` seconds at every later step end."""

    def __init__(
        self, step: int, signum: int = signal.SIGTERM, *, pause: float = 0.0, then: float = 0.0
    ) -> None:
        self.step, self.signum, self.pause, self.then = step, signum, pause, then

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)
            time.sleep(self.pause)
        elif state.global_step > self.step:
            time.sleep(self.then)


class Pause(TrainerCallback):
    """Sleep ``seconds`` at the end of each step from ``step`` on (``until``, if given,
    excluded): slower steps, or (listed after the taskpoint callback) a slower save."""

    def __init__(self, step: int, seconds: float, until: int | None = None) -> None:
        self.step, self.seconds, self.until = step, seconds, until

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step >= self.step and (self.until is None or state.global_step < self.until):
            time.sleep(self.seconds)


def end_process_group() -> None:
    """Destroy the process group torchrun's ranks trained in, before the interpreter exits:
    left to exit, gloo's teardown sometimes aborts a rank that finished cleanly ("terminate
    called without an active exception", exit -6; pytorch/pytorch#179291). Every process
    that loads this module runs it at exit (below), one that ends by an exception too;
    scripts call it last as well."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


atexit.register(end_process_group)


def attempts(url: str) -> list[AttemptRecord]:
    """The attempt records of the checkpoint at ``url``, ascending."""
    return read_attempts(Store(url))


class SlowUpload:
    """A ``progress=`` callback for a checkpoint stored in the local folder ``store``: the
    first upload that starts once the store holds a committed checkpoint (the second save's)
    creates the file ``marker``, then stalls for ``seconds``."""

    def __init__(self, store: str | os.PathLike[str], marker: str | os.PathLike[str], seconds: str | float) -> None:
        self.store, self.marker, self.seconds = Path(store), Path(marker), float(seconds)
        self._done = False

    def __call__(self, moved: int) -> None:
        if self._done or not any((self.store / "checkpoints").glob("*.manifest.json")):
            return
        self._done = True
        self.marker.write_text(str(time.time()))
        time.sleep(self.seconds)


class LogRecorder(TrainerCallback):
    """Keeps a copy of every ``logs`` dict its ``on_log`` is given, as a ``report_to``
    integration would send it (the runs list it before every other callback)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        self.logs.append({**(logs or {}), "step": state.global_step})


@dataclass
class Result:
    """What a finished run is compared by."""

    global_step: int
    losses: list[tuple[int, float]]
    weights: dict[str, torch.Tensor]
    resumed_from: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "losses": self.losses,
            "weights": self.weights,
            "resumed_from": self.resumed_from,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        return cls(
            data["global_step"], [tuple(x) for x in data["losses"]],  # type: ignore[misc]
            data["weights"], data["resumed_from"], data.get("extra", {}),
        )


def assert_same_run(got: Result, want: Result) -> None:
    """Same global step, same loss log, bitwise-equal weights."""
    assert got.global_step == want.global_step
    assert got.losses == want.losses
    assert got.weights.keys() == want.weights.keys()
    different = [k for k in want.weights if not torch.equal(got.weights[k], want.weights[k])]
    assert not different, f"weights differ from the uninterrupted run: {different}"


def _result(trainer: Trainer, resumed: Path | None, logged: LogRecorder | None = None) -> Result:
    losses = [(int(h["step"]), float(h["loss"])) for h in trainer.state.log_history if "loss" in h]
    if trainer.is_fsdp_enabled:  # gather the shards: every rank compares the whole model
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    else:
        state = trainer.model.state_dict()
    weights = {k: v.detach().cpu().clone() for k, v in state.items()}
    extra: dict[str, Any] = {
        "log_history": [dict(entry) for entry in trainer.state.log_history],
        "logs": logged.logs if logged is not None else [],
    }
    return Result(
        trainer.state.global_step, losses, weights, str(resumed) if resumed else None, extra
    )


def _classifier_args(out_dir: Path, **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(out_dir),
        "max_steps": 12,
        "per_device_train_batch_size": 4,
        "save_strategy": "steps",
        "save_steps": 3,
        "save_total_limit": 2,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "report_to": "none",
        "seed": 42,
        "use_cpu": True,
        "disable_tqdm": True,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def classifier_trainer(
    out_dir: Path, *, callbacks: Sequence[TrainerCallback] = (), **overrides: Any
) -> Trainer:
    """A ``Trainer`` for the tiny BERT classifier (built afresh, seeded), its data also
    its evaluation set; ``overrides`` go to its ``TrainingArguments``."""
    args = _classifier_args(out_dir, **overrides)
    tokenizer = word_tokenizer(causal=False)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=2,
    )
    data = ClassificationData(tokenizer)
    return Trainer(
        model=BertForSequenceClassification(config), args=args, train_dataset=data,
        eval_dataset=data, callbacks=list(callbacks),
    )


def run_classifier(
    checkpoint: CheckpointLike | None,
    out_dir: Path,
    *,
    stop: StopAt | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    callback_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Result:
    """Train the tiny BERT classifier, resuming from ``checkpoint`` when it holds state
    (``callback_options``: more arguments of the taskpoint callback)."""
    args = _classifier_args(out_dir, **overrides)
    resume = restore_last_checkpoint(checkpoint, args) if checkpoint is not None else None
    logged = LogRecorder()
    extra: list[TrainerCallback] = [logged]
    if stop is not None:
        extra.append(stop)
    if checkpoint is not None:
        extra.append(TaskpointTrainerCallback(checkpoint, args.output_dir, **(callback_options or {})))
    trainer = classifier_trainer(out_dir, callbacks=[*extra, *callbacks], **overrides)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return _result(trainer, resume, logged)


def run_sft(
    checkpoint: CheckpointLike | None,
    out_dir: Path,
    *,
    stop: StopAt | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    callback_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Result:
    """Train LoRA adapters on the tiny Llama with TRL's SFTTrainer, resuming likewise."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

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
    args = SFTConfig(**options)
    resume = restore_last_checkpoint(checkpoint, args) if checkpoint is not None else None
    tokenizer = word_tokenizer(causal=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    extra = [stop] if stop is not None else []
    if checkpoint is not None:
        extra.append(TaskpointTrainerCallback(checkpoint, args.output_dir, **(callback_options or {})))
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": SENTENCES * 2}),
        processing_class=tokenizer, peft_config=lora, callbacks=[*extra, *callbacks],
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return _result(trainer, resume)


class RecordingCheckpoint:
    """A CheckpointLike that logs each save (what it uploads) and each load, then delegates
    to ``inner``: one JSON line per call in ``log``."""

    def __init__(self, inner: CheckpointLike, log: Path, rank: int = 0) -> None:
        self.inner, self.log, self.rank = inner, log, rank

    def __repr__(self) -> str:
        return f"RecordingCheckpoint({self.inner!r})"

    def _record(self, entry: dict[str, Any]) -> None:
        with self.log.open("a") as fh:
            fh.write(json.dumps({"rank": self.rank, **entry}) + "\n")

    def save_sync(self, data: Any) -> None:
        folder = Path(data)
        found = list(folder.glob("checkpoint-*"))
        self._record({
            "event": "save",
            "newest": max((checkpoint_step(p) or -1 for p in found), default=None),
            "checkpoints": {p.name: sorted(f.name for f in p.iterdir()) for p in found},
        })
        self.inner.save_sync(data)

    async def save(self, data: Any) -> None:
        self.save_sync(data)

    def load_sync(self) -> Path | None:
        self._record({"event": "load"})
        return self.inner.load_sync()

    async def load(self) -> Path | None:
        return self.load_sync()


def read_log(log: Path, event: str) -> list[dict[str, Any]]:
    """The ``event`` ("save" or "load") entries a :class:`RecordingCheckpoint` logged."""
    if not log.exists():
        return []
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [entry for entry in entries if entry["event"] == event]


def read_saves(log: Path) -> list[dict[str, Any]]:
    """The saves a :class:`RecordingCheckpoint` logged, oldest first ([] when none)."""
    return read_log(log, "save")


RECIPES = {"classifier": run_classifier, "sft": run_sft}

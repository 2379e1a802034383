"""The CUDA path: 4-bit base, Unsloth gradient checkpointing, bf16, CUDA RNG restored on resume.

Marked ``gpu``: skipped with the reason where ``torch.cuda.is_available()`` is False. Run
them on a CUDA machine with ``integrations/unsloth/scripts/gpu-tests.sh``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("unsloth", reason="Unsloth is not installed: run these tests with "
                    "`UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth "
                    "pytest integrations/unsloth/tests`")

import taskpoint
import torch
import unsloth_testkit as kit
from taskpoint_unsloth import LORA_RECORD, read_lora_record
from transformers import TrainerCallback

pytestmark = pytest.mark.gpu

# Everything the CUDA path adds over the CPU tests: a 4-bit (bitsandbytes) base model,
# Unsloth's offloaded gradient checkpointing, bf16 autocast and LoRA dropout (which draws
# from the CUDA RNG, so a resume is only exact when that RNG is restored).
MODEL_OPTIONS: dict[str, Any] = {
    "load_in_4bit": True,
    "gradient_checkpointing": "unsloth",
    "lora_dropout": 0.1,
}
TRAIN_OPTIONS: dict[str, Any] = {"use_cpu": False, "bf16": True}


class CudaRngLog(TrainerCallback):
    """Record the CUDA RNG state at the beginning of every step, by global step."""

    def __init__(self) -> None:
        self.states: dict[int, torch.Tensor] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.states[state.global_step] = torch.cuda.get_rng_state().clone()


@dataclass
class Runs:
    reference: kit.Result
    resumed: kit.Result
    reference_rng: dict[int, torch.Tensor]
    resumed_rng: dict[int, torch.Tensor]
    store: str
    base: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """An uninterrupted CUDA run, and one that fails at step 5 and is resumed from step 3."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    root = tmp_path_factory.mktemp("gpu")
    base = kit.make_base_model(root / "tiny-llama-64", hidden_size=64)
    ref_log, resumed_log = CudaRngLog(), CudaRngLog()
    reference = kit.run_unsloth_sft(
        None, root / "reference", base, callbacks=[ref_log],
        model_options=MODEL_OPTIONS, **TRAIN_OPTIONS,
    )
    store = f"file://{root / 'store'}"
    with pytest.raises(kit.Interrupt):
        kit.run_unsloth_sft(
            taskpoint.Checkpoint(store), root / "attempt-1", base, stop=kit.StopAt(5),
            model_options=MODEL_OPTIONS, **TRAIN_OPTIONS,
        )
    resumed = kit.run_unsloth_sft(
        taskpoint.Checkpoint(store), root / "attempt-2", base, callbacks=[resumed_log],
        model_options=MODEL_OPTIONS, **TRAIN_OPTIONS,
    )
    yield Runs(reference, resumed, ref_log.states, resumed_log.states, store, base)
    torch.use_deterministic_algorithms(False)


def test_cuda_is_used_with_4bit_base(runs: Runs) -> None:
    model, _ = kit.load_lora_model(runs.base, **MODEL_OPTIONS)
    assert next(model.parameters()).is_cuda
    quantized = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert quantized, "the base model was not loaded in 4-bit"


def test_interrupted_cuda_run_resumes_to_the_same_step_and_lora_weights(runs: Runs) -> None:
    assert runs.resumed.resumed_from is not None
    assert runs.resumed.resumed_from.endswith("checkpoint-3")
    assert runs.resumed.global_step == runs.reference.global_step == 10
    assert runs.resumed.lora.keys() == runs.reference.lora.keys() and runs.reference.lora
    for name, want in runs.reference.lora.items():
        torch.testing.assert_close(runs.resumed.lora[name], want, rtol=1e-3, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    want_losses = dict(runs.reference.losses)
    got_losses = dict(runs.resumed.losses)
    assert got_losses.keys() == want_losses.keys()
    for step, loss in want_losses.items():
        assert got_losses[step] == pytest.approx(loss, rel=1e-3), step


def test_cuda_rng_state_is_saved_and_restored(runs: Runs) -> None:
    tree = taskpoint.Checkpoint(runs.store).load_sync()
    assert tree is not None
    rng = torch.load(tree / "checkpoint-9" / "rng_state.pth", weights_only=False)
    assert "cuda" in rng
    # The resumed run starts at step 3 with the CUDA RNG exactly where the reference had it.
    assert min(runs.resumed_rng) == 3
    for step in sorted(runs.resumed_rng):
        assert torch.equal(runs.resumed_rng[step], runs.reference_rng[step]), step


def test_4bit_checkpoint_holds_only_the_adapter(runs: Runs) -> None:
    tree = taskpoint.Checkpoint(runs.store).load_sync()
    assert tree is not None
    saved = tree / "checkpoint-9"
    names = {p.name for p in saved.iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", LORA_RECORD} <= names
    assert not list(tree.rglob("model*.safetensors"))
    record = read_lora_record(saved)
    assert record is not None and record.r == 4
    base_bytes = (runs.base / "model.safetensors").stat().st_size
    assert (saved / "adapter_model.safetensors").stat().st_size < base_bytes / 4

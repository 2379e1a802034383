"""``TaskpointUnslothCallback`` and ``restore_lora_checkpoint`` on Flyte's own checkpoint: a
real local Flyte run with retries resumes LoRA fine-tuning from the previous attempt's newest
``checkpoint-N`` and ends exactly where an uninterrupted run does."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("unsloth", reason="Unsloth is not installed: run these tests with "
                    "`UV_PROJECT_ENVIRONMENT=.venv-unsloth uv run --only-group unsloth "
                    "pytest integrations/unsloth/tests`")

import flyte
import taskpoint
import unsloth_testkit as kit
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

# flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning")

# Flyte's local controller waits 0.5 s, 1 s, 2 s... between attempts unless told otherwise.
NO_WAIT = flyte.Backoff(base=datetime.timedelta(0))


def test_flyte_retries_resume_lora_fine_tuning(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    base_model: Path,
    reference: Callable[..., kit.Result],
) -> None:
    monkeypatch.chdir(tmp_path)
    env = flyte.TaskEnvironment(name="tp_unsloth_flyte")
    out = tmp_path / "out"  # the same output_dir for every attempt, as in one process
    # Saves every 3 steps: attempt 1 dies at step 5 (checkpoint-3 saved), attempt 2 at
    # step 7 (checkpoint-6 saved), attempt 3 runs to step 10.
    stops = [kit.StopAt(5), kit.StopAt(7), None]
    starts: list[int] = []
    results: list[kit.Result] = []
    kinds: list[bool] = []

    @env.task(retries=flyte.RetryStrategy(count=2, backoff=NO_WAIT))
    def train() -> int:
        ckpt = flyte.ctx().checkpoint
        kinds.append(isinstance(ckpt, taskpoint.Checkpoint))
        stop = stops[len(kinds) - 1]
        results.append(
            kit.run_unsloth_sft(ckpt, out, base_model, stop=stop, callbacks=[_StartStep(starts)])
        )
        return len(kinds)

    flyte.init()
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "flyte-raw")).run(train)

    assert run.outputs()[0] == 3, "three attempts: two failed, the third finished"
    assert kinds == [False, False, False], "the checkpoint was Flyte's, not taskpoint's"
    assert starts == [0, 3, 6], "each retry resumed from the previous attempt's newest save"
    assert len(results) == 1 and results[0].resumed_from == str(out / "checkpoint-6")
    kit.assert_same_run(results[0], reference())


class _StartStep(TrainerCallback):
    """Records the global step each attempt's training starts from (after its resume)."""

    def __init__(self, starts: list[int]) -> None:
        self.starts = starts

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.starts.append(state.global_step)

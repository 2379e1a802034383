"""``TaskpointTrainerCallback`` and ``restore_last_checkpoint`` on Flyte's own checkpoint: a
real local Flyte run with retries resumes the Trainer from the previous attempt's newest
``checkpoint-N`` and ends exactly where an uninterrupted run does."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flyte
import pytest
import taskpoint
import taskpoint_hf_testkit as kit
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

# flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning")

# Flyte's local controller waits 0.5 s, 1 s, 2 s... between attempts unless told otherwise.
NO_WAIT = flyte.Backoff(base=datetime.timedelta(0))




def test_flyte_retries_resume_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Callable[..., kit.Result]
) -> None:
    monkeypatch.chdir(tmp_path)
    env = flyte.TaskEnvironment(name="tp_hf_flyte")
    out = tmp_path / "out"  # the same output_dir for every attempt, as in one process
    # Saves every 3 steps: attempt 1 dies at step 4 (checkpoint-3 saved), attempt 2 at
    # step 8 (checkpoint-6 saved), attempt 3 runs to step 12.
    stops = [kit.StopAt(4), kit.StopAt(8), None]
    starts: list[int] = []
    results: list[kit.Result] = []
    kinds: list[bool] = []

    @env.task(retries=flyte.RetryStrategy(count=2, backoff=NO_WAIT))
    def train() -> int:
        ckpt = flyte.ctx().checkpoint
        kinds.append(isinstance(ckpt, taskpoint.Checkpoint))
        stop = stops[len(kinds) - 1]
        results.append(kit.run_classifier(ckpt, out, stop=stop, callbacks=[_StartStep(starts)]))
        return len(kinds)

    flyte.init()
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "flyte-raw")).run(train)

    assert run.outputs()[0] == 3, "three attempts: two failed, the third finished"
    assert kinds == [False, False, False], "the checkpoint was Flyte's, not taskpoint's"
    assert starts == [0, 3, 6], "each retry resumed from the previous attempt's newest save"
    assert len(results) == 1 and results[0].resumed_from == str(out / "checkpoint-6")
    kit.assert_same_run(results[0], reference("classifier"))


class _StartStep(TrainerCallback):
    """Records the global step each attempt's training starts from (after its resume)."""

    def __init__(self, starts: list[int]) -> None:
        self.starts = starts

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.starts.append(state.global_step)

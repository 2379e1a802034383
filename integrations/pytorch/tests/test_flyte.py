"""``TaskpointState`` on Flyte's own checkpoint: a real local Flyte run with retries resumes
from the previous attempt and ends bit for bit where an uninterrupted run does."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import flyte
import pytest
import taskpoint
from taskpoint_pytorch import ResumePoint

# flyte.io's pydantic models use class-based config (Flyte's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:Support for class-based:DeprecationWarning")

# Flyte's local controller waits 0.5 s, 1 s, 2 s... between attempts unless told otherwise.
NO_WAIT = datetime.timedelta(0)




def _retries(count: int) -> flyte.RetryStrategy:
    return flyte.RetryStrategy(count=count, backoff=flyte.Backoff(base=NO_WAIT))


@pytest.fixture
def run_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Run a Flyte task in local mode, its checkpoint objects under ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    flyte.init()

    def run(task: Any, *args: Any) -> Any:
        raw = str(tmp_path / "flyte-raw")
        return flyte.with_runcontext(mode="local", raw_data_path=raw).run(task, *args)

    return run


@pytest.fixture(scope="module")
def reference(lib: ModuleType) -> dict[str, Any]:
    """An uninterrupted run, with no checkpointing at all."""
    return lib.run(lib.build())


# Attempt 1 dies mid-epoch 2 (epoch 1 saved), attempt 2 mid-epoch 4 (epochs up to 3 saved).
FAILURES = (6, 14)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_flyte_retries_resume_bitwise(
    lib: ModuleType, reference: dict[str, Any], run_local: Callable[..., Any], mode: str
) -> None:
    env = flyte.TaskEnvironment(name=f"tp_torch_flyte_{mode}")
    pending = set(FAILURES)
    starts: list[int] = []
    results: list[dict[str, Any]] = []
    kinds: list[bool] = []

    def before_step(step: int) -> None:
        if step in pending:
            pending.discard(step)
            raise RuntimeError(f"simulated failure before step {step}")

    def on_resume(resume: ResumePoint | None) -> None:
        starts.append(resume.epoch if resume else 0)

    if mode == "sync":

        @env.task(retries=_retries(len(FAILURES)))
        def train() -> int:
            checkpoint = flyte.ctx().checkpoint
            kinds.append(isinstance(checkpoint, taskpoint.Checkpoint))
            parts = lib.build()
            results.append(
                lib.run(
                    parts, parts.state(), checkpoint, before_step=before_step, on_resume=on_resume
                )
            )
            return len(starts)

        task: Any = train
    else:

        @env.task(retries=_retries(len(FAILURES)))
        async def atrain() -> int:
            checkpoint = flyte.ctx().checkpoint
            kinds.append(isinstance(checkpoint, taskpoint.Checkpoint))
            parts = lib.build()
            results.append(
                await lib.run_async(
                    parts, parts.state(), checkpoint, before_step=before_step, on_resume=on_resume
                )
            )
            return len(starts)

        task = atrain

    outputs = run_local(task).outputs()

    assert outputs[0] == 3, "three attempts: two failed, the third finished"
    assert kinds == [False, False, False], "the checkpoint was Flyte's, not taskpoint's"
    assert not pending, "every simulated failure happened"
    # Saves happen at epoch ends (4 steps each): each retry starts where the last left off.
    assert starts == [0, 1, 3]
    assert len(results) == 1
    assert lib.bitwise_differences(results[0], reference) == []

"""A training run interrupted by exceptions ends bit for bit where an uninterrupted one does."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import taskpoint
from taskpoint_pytorch import ResumePoint


@pytest.fixture(scope="module")
def reference(lib: ModuleType) -> dict[str, Any]:
    """An uninterrupted run, with no checkpointing at all."""
    return lib.run(lib.build())


def _expected_starts(lib: ModuleType, failures: tuple[int, ...]) -> list[int]:
    # Saves happen at epoch ends, so a failure before step s resumes at the epochs completed.
    return [0] + [(step - 1) // lib.STEPS_PER_EPOCH for step in failures]


# Failure points: before any save, right after a save, mid-epoch twice, at every epoch start.
FAILURES = [(3,), (5,), (6, 14), (5, 9, 13, 17)]

ONE_OBJECT_STORE = pytest.mark.stores("file", "s3")
"""For the tests of where a resumed run starts and what it carries over, the same bytes on
every store; ``test_uninterrupted_run_with_saves_matches_plain_run`` runs on every store."""


@ONE_OBJECT_STORE
@pytest.mark.parametrize("failures", FAILURES, ids=lambda f: "fail-" + "-".join(map(str, f)))
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_interrupted_run_is_bitwise_equal_to_uninterrupted(
    lib: ModuleType, reference: dict[str, Any], store_url: str, failures: tuple[int, ...], mode: str
) -> None:
    env = taskpoint.TaskEnvironment(name="exact", root=store_url)
    pending = set(failures)
    starts: list[int] = []

    def before_step(step: int) -> None:
        if step in pending:
            pending.discard(step)
            raise RuntimeError(f"simulated failure before step {step}")

    def on_resume(resume: ResumePoint | None) -> None:
        starts.append(resume.epoch if resume else 0)

    if mode == "sync":

        @env.task(retries=len(failures), backoff=0)
        def train() -> dict[str, Any]:
            checkpoint = taskpoint.ctx().checkpoint
            parts = lib.build()
            return lib.run(
                parts, parts.state(), checkpoint, before_step=before_step, on_resume=on_resume
            )

        result = train()
    else:

        @env.task(retries=len(failures), backoff=0)
        async def atrain() -> dict[str, Any]:
            checkpoint = taskpoint.ctx().checkpoint
            parts = lib.build()
            return await lib.run_async(
                parts, parts.state(), checkpoint, before_step=before_step, on_resume=on_resume
            )

        result = await atrain()

    assert not pending, "every simulated failure happened"
    assert starts == _expected_starts(lib, failures)
    assert lib.bitwise_differences(result, reference) == []


@ONE_OBJECT_STORE
def test_without_rng_restore_the_resumed_run_differs(
    lib: ModuleType, reference: dict[str, Any], store_url: str
) -> None:
    """The control: the same interruption without RNG restore does not match, so the
    equality above is owed to the restored generators."""
    env = taskpoint.TaskEnvironment(name="control", root=store_url)
    pending = {9}

    def before_step(step: int) -> None:
        if step in pending:
            pending.discard(step)
            raise RuntimeError("simulated failure")

    @env.task(retries=1, backoff=0)
    def train() -> dict[str, Any]:
        parts = lib.build()
        state = parts.state(rng=False)
        return lib.run(parts, state, taskpoint.ctx().checkpoint, before_step=before_step)

    result = train()
    assert not pending
    assert lib.bitwise_differences(result["model"], reference["model"]) != []


def test_uninterrupted_run_with_saves_matches_plain_run(
    lib: ModuleType, reference: dict[str, Any], store_url: str
) -> None:
    """Saving draws no random numbers: checkpointing alone does not change training."""
    parts = lib.build()
    checkpoint = taskpoint.Checkpoint(store_url)
    result = lib.run(parts, parts.state(), checkpoint)
    assert lib.bitwise_differences(result, reference) == []
    assert len(checkpoint.committed()) == 1

"""``save_on_exception=True``: an exception that ends the attempt saves the bundle as it was
at the last ``save_sync`` call that did not save, so the retry resumes at that chunk and
ends bit for bit as an uninterrupted run. Saves every 3 chunks; the failure comes in chunk
8 (after the call for chunk 7, which did not save), before or after its ``partial_fit``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import taskpoint
from taskpoint import TaskpointWarning
from taskpoint_sklearn import TaskpointSklearnCheckpoint

CHUNKS = 12
CASE = "SGDClassifier"


def _run(cases: ModuleType, root: Path, *, on: bool, where: str) -> tuple[list[int], object]:
    """Train under ``@env.task(retries=1)``; attempt 0 fails in chunk 8 (``where``: before
    or after its ``partial_fit``). The progress each attempt started at, and the estimator."""
    case = cases.CASES[CASE]
    env = taskpoint.TaskEnvironment(name="sk-failure", root=str(root))
    starts: list[int] = []

    @env.task(retries=1, backoff=0.0)
    def train() -> object:
        ckpt = TaskpointSklearnCheckpoint(taskpoint.ctx().checkpoint, save_on_exception=on)
        bundle = ckpt.resume_sync(case.make(), rng=np.random.default_rng(0))
        starts.append(bundle.progress)
        for i in range(bundle.progress, CHUNKS):
            failing = i == 7 and taskpoint.ctx().attempt == 0  # type: ignore[union-attr]
            if failing and where == "before":
                raise RuntimeError("a corrupt chunk")
            cases.train_chunk(case, bundle.estimator, bundle.rng)
            if failing:
                raise RuntimeError("a failure after the chunk trained")  # bundle changed
            bundle.progress = i + 1
            ckpt.save_sync(bundle, every=3)
        return bundle.estimator

    return starts, train()


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("on", [True, False], ids=["save_on_exception", "without"])
def test_the_retry_resumes_at_the_last_call_and_ends_exactly(
    cases: ModuleType, tmp_path: Path, on: bool, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The bundle saved is the copy taken at chunk 7's call, so a failure after chunk 8's
    ``partial_fit`` changed the live estimator still saves chunk 7's state."""
    with caplog.at_level(logging.WARNING):
        starts, estimator = _run(cases, tmp_path / "store", on=on, where=where)
    assert starts == [0, 7 if on else 6]
    assert ("saved the bundle of progress 7 at the failure (RuntimeError)" in caplog.text) is on
    case = cases.CASES[CASE]
    cases.assert_same_fit(case, estimator, cases.uninterrupted(case, CHUNKS))


def test_a_call_that_saved_leaves_nothing_to_save_at_the_failure(
    cases: ModuleType, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The failure comes right after the call for chunk 6, which saved: nothing more."""
    case = cases.CASES[CASE]
    env = taskpoint.TaskEnvironment(name="sk-failure", root=str(tmp_path / "store"))
    ckpts: list[TaskpointSklearnCheckpoint] = []

    @env.task(retries=0)
    def train() -> None:
        ckpt = TaskpointSklearnCheckpoint(taskpoint.ctx().checkpoint, save_on_exception=True)
        ckpts.append(ckpt)
        bundle = ckpt.resume_sync(case.make(), rng=np.random.default_rng(0))
        for i in range(6):
            cases.train_chunk(case, bundle.estimator, bundle.rng)
            bundle.progress = i + 1
            ckpt.save_sync(bundle, every=3)
        raise RuntimeError("after a saving call")

    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="saving call"):
        train()
    assert "at the failure" not in caplog.text
    restored = ckpts[0].load_sync()
    assert restored is not None and restored.progress == 6


def test_outside_a_task_it_warns_that_it_cannot_save(tmp_path: Path, cases: ModuleType) -> None:
    case = cases.CASES[CASE]
    ckpt = TaskpointSklearnCheckpoint(
        taskpoint.Checkpoint(str(tmp_path / "store")), save_on_exception=True
    )
    bundle = ckpt.resume_sync(case.make(), rng=np.random.default_rng(0))
    bundle.progress = 1
    with pytest.warns(TaskpointWarning, match="saves only inside a taskpoint task") as seen:
        ckpt.save_sync(bundle, every=3)
    assert seen[0].filename == __file__  # it names the caller's line


def test_save_on_exception_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="save_on_exception must be True or False; got 1"):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(str(tmp_path)), save_on_exception=1)  # type: ignore[arg-type]

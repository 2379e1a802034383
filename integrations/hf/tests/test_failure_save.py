"""``save_on_exception=True``: an exception out of ``trainer.train()`` that left the model as
the last completed step left it has the Trainer write that step's ``checkpoint-N``, uploaded
before the exception leaves ``train()``; the retry, on a fresh disk, resumes there and ends
bit for bit as an uninterrupted run. Saves every 3 steps; the failures come after step 4.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import taskpoint
import taskpoint_hf_testkit as kit
from taskpoint import Checkpoint
from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint

RECIPES = [
    "classifier",
    pytest.param("sft", marks=pytest.mark.slow),  # TRL's SFTTrainer, LoRA with dropout
]


def _resumed_at(checkpoint: Checkpoint, out: Path, recipe: str) -> int | None:
    """The step the next attempt resumes at, restored onto a fresh disk."""
    found = restore_last_checkpoint(checkpoint, out / recipe)
    return None if found is None else int(found.name.rsplit("-", 1)[1])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("on", [True, False], ids=["save_on_exception", "without"])
def test_a_failure_in_a_forward_pass_saves_the_last_step_and_the_retry_resumes_there_exactly(
    tmp_path: Path, recipe: str, on: bool, reference: Callable[..., kit.Result],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The forward pass of step 5 fails after the dropout masks were drawn: step 4 is
    written (its RNG state the one at step 4's end, not the advanced one) and committed;
    without the option the retry goes back to checkpoint-3."""
    run = kit.RECIPES[recipe]
    checkpoint = Checkpoint(str(tmp_path / "store"))
    options = {"save_on_exception": on}
    with caplog.at_level(logging.WARNING), pytest.raises(kit.Interrupt, match="after step 4"):
        run(checkpoint, tmp_path / "first", callbacks=[kit.FailInForward(4)],
            callback_options=options)
    assert ("wrote checkpoint-4 at the failure (Interrupt)" in caplog.text) is on

    assert _resumed_at(checkpoint, tmp_path / "probe", recipe) == (4 if on else 3)
    resumed = run(checkpoint, tmp_path / "retry", callback_options=options)
    assert resumed.resumed_from == str(tmp_path / "retry" / f"checkpoint-{4 if on else 3}")
    kit.assert_same_run(resumed, reference(recipe))


@pytest.mark.stores("file", "s3")
def test_a_tasks_retry_resumes_at_the_step_saved_at_the_failure(
    store_url: str, tmp_path: Path, reference: Callable[..., kit.Result]
) -> None:
    """``@env.task(retries=1)``, as the guide runs it: attempt 0 fails in step 5's forward
    pass, attempt 1 (another output_dir: a new node) resumes at 4 and ends exactly."""
    env = taskpoint.TaskEnvironment(name="hf", root=store_url)
    attempts: list[tuple[int, str | None]] = []

    @env.task(retries=1, backoff=0.0)
    def train() -> kit.Result:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        out = tmp_path / f"node-{context.attempt}"
        fail = [kit.FailInForward(4)] if context.attempt == 0 else []
        try:
            result = kit.run_classifier(context.checkpoint, out, callbacks=fail,
                                        callback_options={"save_on_exception": True})
        except kit.Interrupt:
            attempts.append((context.attempt, None))
            raise
        attempts.append((context.attempt, result.resumed_from))
        return result

    result = train()
    assert attempts == [(0, None), (1, str(tmp_path / "node-1" / "checkpoint-4"))]
    kit.assert_same_run(result, reference("classifier"))


def test_a_failure_right_after_the_trainers_own_save_writes_nothing_more(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 3 was saved by the save strategy: the failure in step 4's forward pass has
    nothing to add, and the retry resumes at 3."""
    checkpoint = Checkpoint(str(tmp_path / "store"))
    options = {"save_on_exception": True}
    with caplog.at_level(logging.WARNING), pytest.raises(kit.Interrupt):
        kit.run_classifier(checkpoint, tmp_path / "first", callbacks=[kit.FailInForward(3)],
                           callback_options=options)
    assert "at the failure" not in caplog.text
    assert _resumed_at(checkpoint, tmp_path / "probe", "classifier") == 3


def test_a_failure_after_the_optimizer_stepped_saves_nothing_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, reference: Callable[..., kit.Result]
) -> None:
    """The failure comes at step 5's end, before the taskpoint callback saw it (listed
    before it): the optimizer has stepped since step 4 ended, so saving now as step 4
    would resume wrongly. Nothing is written; the retry resumes at 3, still exactly."""
    checkpoint = Checkpoint(str(tmp_path / "store"))
    options = {"save_on_exception": True}
    with caplog.at_level(logging.WARNING), pytest.raises(kit.Interrupt):
        kit.run_classifier(checkpoint, tmp_path / "first", stop=kit.StopAt(5),
                           callback_options=options)
    assert (
        "no checkpoint at the failure (Interrupt): since step 4 ended, an optimizer stepped"
        in caplog.text
    ), caplog.text
    assert not (tmp_path / "first" / "checkpoint-4").exists()
    assert _resumed_at(checkpoint, tmp_path / "probe", "classifier") == 3
    resumed = kit.run_classifier(checkpoint, tmp_path / "retry", callback_options=options)
    kit.assert_same_run(resumed, reference("classifier"))


def test_save_on_exception_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="save_on_exception must be True or False; got 'yes'"):
        TaskpointTrainerCallback(Checkpoint(str(tmp_path)), save_on_exception="yes")  # type: ignore[arg-type]

"""SIGTERM becomes a save at a step boundary; training that ends by an exception waits for
the upload in flight (issue #25).

Each test trains the tiny BERT classifier in this process against a ``file://`` store and
signals the process itself (a real SIGTERM through the real handlers); inside a task the
runner retries and writes the records asserted here. Process-level cases (torchrun, two
nodes, SIGKILL) are in ``test_preemption_processes.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import taskpoint
import taskpoint_hf_testkit as kit
from taskpoint import Checkpoint, preemption
from taskpoint_hf import TaskpointTrainerCallback, last_complete_checkpoint
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

JIT = "enable_jit_checkpoint" in TrainingArguments.__dataclass_fields__


def _train_in_a_task(
    tmp_path: Path, first_attempt: list[TrainerCallback], **overrides: Any
) -> tuple[kit.Result, list[str], str]:
    """The classifier as a task with one retry; ``first_attempt``'s callbacks join attempt
    0 only. Returns the result, what each attempt raised, and the action's URL."""
    root = (tmp_path / "store").as_uri()
    env = taskpoint.TaskEnvironment(name="hf", root=root, run_id="r1", keep=5)
    raised: list[str] = []

    @env.task(retries=1, backoff=0.0)
    def train() -> kit.Result:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        extra = first_attempt if context.attempt == 0 else []
        try:
            return kit.run_classifier(
                context.checkpoint, tmp_path / "out", callbacks=extra, **overrides
            )
        except BaseException as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
            raise

    return train(), raised, f"{root}/hf.train/r1"


@pytest.mark.parametrize(
    "jit", [False, pytest.param(True, marks=pytest.mark.skipif(not JIT, reason="no JIT"))],
    ids=["plain", "enable_jit_checkpoint"],
)
def test_sigterm_in_a_task_saves_at_the_step_boundary_and_the_retry_resumes_exactly(
    tmp_path: Path, reference: Callable[..., kit.Result], jit: bool
) -> None:
    """The signal arrives after the callback's vote at step 7: every rank stops at step 8,
    the Trainer writes checkpoint-8 (no regular save there), it commits, the attempt ends
    preempted and the retry resumes at step 8 with the uninterrupted run's result. With
    ``enable_jit_checkpoint`` the Trainer's own handler (installed over taskpoint's) does
    not hide the signal, and its mid-step save is not made."""
    options = {"enable_jit_checkpoint": True} if jit else {}
    result, raised, url = _train_in_a_task(tmp_path, [kit.SignalAt(7)], **options)

    assert len(raised) == 1 and raised[0].startswith("Preempted"), raised
    assert "stopped at step 8: checkpoint-8 committed" in raised[0]
    kit.assert_same_run(result, reference("classifier"))
    first, second = kit.attempts(url)
    assert (first.outcome, first.step, first.preemption_save) == ("preempted", 8, "committed")
    assert (second.outcome, second.resumed_step) == ("succeeded", 8)
    marked = [m for m in Checkpoint(url).committed() if m.preemption]
    assert [(m.attempt, m.step) for m in marked] == [(0, 8)]


def test_a_save_that_cannot_commit_within_the_grace_period_is_skipped_and_recorded_missed(
    tmp_path: Path,
    reference: Callable[..., kit.Result],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The save at step 6 took over 2.5 s (a slow write): with a 3 s grace period the save
    at step 8 cannot fit, so none is made; the retry resumes from checkpoint-6."""
    monkeypatch.setenv("TASKPOINT_GRACE_PERIOD", "3")
    slow_write = kit.Pause(6, 2.5, until=7)  # after the callback asked for checkpoint-6
    with caplog.at_level(logging.WARNING, logger="taskpoint_hf"):
        result, raised, url = _train_in_a_task(tmp_path, [slow_write, kit.SignalAt(7)])

    assert len(raised) == 1 and "stopped at step 8: no save" in raised[0], raised
    assert "stopping at step 8 WITHOUT saving: a save takes about" in caplog.text
    kit.assert_same_run(result, reference("classifier"))
    first, second = kit.attempts(url)
    assert (first.outcome, first.step, first.preemption_save) == ("preempted", 8, "missed")
    assert second.resumed_step == 6
    assert not [m for m in Checkpoint(url).committed() if m.preemption]


class _Gate:
    """A ``progress=`` callback that holds uploads while closed."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.held = threading.Event()

    def __call__(self, moved: int) -> None:
        if not self.opened.is_set():
            self.held.set()
            assert self.opened.wait(timeout=120), "the test never opened the gate"


class _At(TrainerCallback):
    def __init__(self, **actions: Callable[[], Any]) -> None:
        self.actions = actions

    def _at(self, key: str) -> None:
        if key in self.actions:
            self.actions[key]()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._at(f"save_{state.global_step}")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._at(f"step_{state.global_step}")


def test_an_exception_one_step_after_a_save_waits_for_its_upload_and_the_retry_resumes_there(
    tmp_path: Path, reference: Callable[..., kit.Result]
) -> None:
    """checkpoint-6's upload is held when step 7 raises: ``train()`` raises only once it
    has committed, so the store's newest checkpoint is the one saved a step before. The
    retry (a new attempt on the same store) resumes from it, as its record says, and ends
    as the uninterrupted run."""
    gate = _Gate()
    url = (tmp_path / "store").as_uri()
    checkpoint = Checkpoint(url, keep=5, progress=gate)
    callback = TaskpointTrainerCallback(checkpoint)

    def hold() -> None:
        callback.wait()  # checkpoint-3 has committed: hold checkpoint-6's upload only
        gate.opened.clear()

    def fail() -> None:
        assert gate.held.wait(timeout=120), "checkpoint-6's upload never started"
        threading.Timer(1.5, gate.opened.set).start()
        raise kit.Interrupt("step 7 failed")

    at = _At(save_6=hold, step_7=fail)
    started = time.monotonic()
    with pytest.raises(kit.Interrupt):
        kit.run_classifier(None, tmp_path / "out", callbacks=[at, callback])
    restored = Checkpoint(url).load_sync()  # right away: nothing else waited
    assert restored is not None
    newest = last_complete_checkpoint(restored)
    assert newest == restored / "checkpoint-6", f"train() raised before checkpoint-6 committed: {newest}"
    assert Checkpoint(url).committed()[0].step == 6
    assert time.monotonic() - started >= 1.5

    result = kit.run_classifier(Checkpoint(url, keep=5), tmp_path / "out")
    assert result.resumed_from == str(tmp_path / "out" / "checkpoint-6")
    kit.assert_same_run(result, reference("classifier"))
    assert [a.resumed_step for a in kit.attempts(url)] == [None, 6]


@pytest.mark.skipif(not JIT, reason="this transformers has no just-in-time checkpoints")
def test_jit_outside_a_task_saves_at_the_step_boundary_and_resumes_exactly(
    tmp_path: Path, reference: Callable[..., kit.Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the environment contract (no task), ``enable_jit_checkpoint`` asks for a save
    on SIGTERM: taskpoint makes it at the step boundary, and the run resumes exactly."""
    monkeypatch.setenv("TASKPOINT_ACTION", "hf-jit")
    monkeypatch.setenv("TASKPOINT_ROOT", str(tmp_path / "runtime"))
    url = (tmp_path / "store").as_uri()
    out = tmp_path / "out"
    with pytest.raises(taskpoint.Preempted, match="stopped at step 8: checkpoint-8 committed"):
        kit.run_classifier(
            Checkpoint(url), out, callbacks=[kit.SignalAt(7)], enable_jit_checkpoint=True
        )
    restored = Checkpoint(url).load_sync()
    assert restored is not None and last_complete_checkpoint(restored) == restored / "checkpoint-8"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]

    preemption.reset()  # the next attempt: a new process, as the orchestrator starts it
    result = kit.run_classifier(Checkpoint(url), out, enable_jit_checkpoint=True)
    assert result.resumed_from == str(out / "checkpoint-8")
    kit.assert_same_run(result, reference("classifier"))


@pytest.mark.skipif(not JIT, reason="this transformers has no just-in-time checkpoints")
def test_the_trainers_own_jit_checkpoint_under_an_uploaded_name_is_uploaded_and_named_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the switch off, transformers saves on SIGTERM its own way: here (the signal
    waits out its 3 s at step 6) it writes checkpoint-6 again before step 7, after the
    regular checkpoint-6 was uploaded. The store gets the rewritten one, and the log says
    the resume from it may not be exact."""
    monkeypatch.setenv("TASKPOINT_SAVE_ON_PREEMPTION", "0")
    log = tmp_path / "saves.jsonl"
    url = (tmp_path / "store").as_uri()
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="taskpoint_hf"):
        kit.run_classifier(
            kit.RecordingCheckpoint(Checkpoint(url), log), out,
            callbacks=[kit.SignalAt(6, pause=4.5)], max_steps=40, enable_jit_checkpoint=True,
        )
    assert last_complete_checkpoint(out) == out / "checkpoint-6"
    assert [entry["newest"] for entry in kit.read_saves(log)] == [3, 6, 6]  # the JIT's too
    restored = Checkpoint(url).load_sync()
    assert restored is not None and last_complete_checkpoint(restored) == restored / "checkpoint-6"
    assert "just-in-time checkpoint-6 at on_step_begin" in caplog.text, caplog.text

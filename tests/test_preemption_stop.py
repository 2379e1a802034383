"""The preemption stop every adapter shares (``taskpoint.runtime.preemption_stop``): its
decisions, taken in one process (the agreement of a process alone is its own values).
Each adapter's own tests run it across ranks, with real signals and saves."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import taskpoint
from taskpoint import preemption
from taskpoint.checkpoint.job_mirror import JobMirror
from taskpoint.format.history import read_attempts
from taskpoint.runtime.preemption_stop import (
    MARGIN_S,
    Alone,
    PreemptionStop,
    wait_on_preemption,
    within_grace,
)
from taskpoint.store.store import Store

GRACE_S = 8.0


@pytest.fixture(autouse=True)
def _no_notice() -> Iterator[None]:
    handler = signal.getsignal(signal.SIGTERM)
    preemption.reset()
    yield
    preemption.reset()
    signal.signal(signal.SIGTERM, handler)


class Waits:
    """A wait for an upload in flight that is done (or not) and notes the bounds it got."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.bounds: list[float] = []

    def __call__(self, timeout: float) -> bool:
        self.bounds.append(timeout)
        return self.done


def _stopping() -> PreemptionStop:
    stop = PreemptionStop(timeout=30, agreement=lambda _timeout: Alone())
    stop.begin()
    preemption.relay(GRACE_S)  # as a signal GRACE_S seconds before the kill would
    assert stop.requested()
    return stop


def test_the_one_margin_is_a_second() -> None:
    assert MARGIN_S == 1.0
    preemption.relay(GRACE_S)
    assert within_grace(None) == pytest.approx(GRACE_S - MARGIN_S, abs=0.5)
    assert within_grace(2.0) == 2.0


def test_a_real_sigterm_is_deferred_to_the_step_boundary_and_stops_there() -> None:
    stop = PreemptionStop(timeout=30)  # the default agreement: no process group, alone
    stop.begin()
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # only noted: the process goes on
        assert stop.requested()
        assert preemption.notice() is not None
    finally:
        stop.close()


def test_an_upload_in_flight_that_does_not_finish_means_no_save() -> None:
    stop = _stopping()
    wait = Waits(done=False)
    decision = stop.decide(7, wait=wait, estimate=lambda: 0.1)
    assert not decision.saving and decision.step == 7
    assert decision.reason == "the upload in flight did not finish in time"
    # The wait ends MARGIN_S before the deadline.
    (bound,) = wait.bounds
    assert GRACE_S - MARGIN_S - 0.5 < bound <= GRACE_S - MARGIN_S
    assert not stop.requested()  # decided: no second stop
    stop.close()


def test_a_save_that_does_not_fit_in_the_time_left_less_the_margin_is_not_made() -> None:
    stop = _stopping()
    # It would fit in what is left, but not once the margin is kept back.
    decision = stop.decide(7, wait=Waits(done=True), estimate=lambda: GRACE_S - MARGIN_S / 2)
    assert not decision.saving
    assert decision.reason.startswith(f"a save takes about {GRACE_S - MARGIN_S / 2:.1f}s")
    stop.close()


def test_with_no_save_timed_only_the_time_left_decides() -> None:
    stop = _stopping()
    assert stop.decide(7, wait=Waits(done=True), estimate=lambda: None).saving
    stop.close()


def test_a_save_that_fits_is_made_committed_recorded_and_the_stop_raises(
    tmp_path: Path,
) -> None:
    ckpt = taskpoint.Checkpoint(tmp_path / "store")
    stop = _stopping()
    decision = stop.decide(
        7, wait=Waits(done=True), estimate=lambda: 1.0, also=lambda: [True, False]
    )
    assert decision.saving and decision.reason == ""
    assert decision.agreed == (True, False)
    assert decision.budget() == pytest.approx(decision.left() - MARGIN_S, abs=0.1)
    ckpt.save_sync(b"state at step 7")
    commit = Waits(done=True)
    assert stop.committed(commit)
    (bound,) = commit.bounds
    assert bound <= GRACE_S - MARGIN_S
    assert not stop.committed(Waits(done=False))  # a commit still running is no commit
    with pytest.raises(taskpoint.Preempted, match="stopped at step 7: committed") as raised:
        stop.end("SIGTERM: stopped at step 7: committed", step=7, leader=True, checkpoint=ckpt)
    assert stop.stopped is raised.value
    (record,) = read_attempts(Store(str(tmp_path / "store")))
    assert (record.outcome, record.step, record.preemption_save) == ("preempted", 7, "committed")
    assert not stop.active  # the deferral is over


def test_only_the_leader_records_the_end(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(tmp_path / "store")
    stop = _stopping()
    stop.decide(7, wait=Waits(done=True), estimate=lambda: None)
    with pytest.raises(taskpoint.Preempted):
        stop.end("stopped", step=7, leader=False, checkpoint=ckpt)
    assert read_attempts(Store(str(tmp_path / "store"))) == []


def test_wait_on_preemption_gives_the_task_one_bounded_wait_for_the_leaders_upload(
    tmp_path: Path,
) -> None:
    class Job(JobMirror):
        """Notes the bound of each wait for its upload in flight."""

        def __init__(self) -> None:
            super().__init__(taskpoint.Checkpoint(tmp_path / "store"))
            self.waits: list[float | None] = []

        def wait_on_signal(self, timeout: float | None) -> None:
            self.waits.append(timeout)

    led, short, other = Job(), Job(), Job()
    wait_on_preemption(led, 60.0, leader=True)  # outside a task: nothing to register with
    env = taskpoint.TaskEnvironment(name="waits", root=str(tmp_path / "root"))

    @env.task
    def train() -> None:
        for _start in range(2):  # each training start registers again: one wait all the same
            wait_on_preemption(led, 60.0, leader=True)
            wait_on_preemption(short, 2.0, leader=True)
            wait_on_preemption(other, 60.0, leader=False)  # not the rank that waits
        preemption.relay(GRACE_S)  # as SIGTERM would, before the task's callbacks run
        context = taskpoint.ctx()
        assert context is not None
        context._run_preempt_callbacks()
        preemption.reset()  # the attempt then succeeds: its waits are what is looked at

    train()
    assert led.waits == [pytest.approx(GRACE_S - MARGIN_S, abs=0.5)]  # the grace period's
    assert short.waits == [2.0] and other.waits == []


def test_outside_the_main_thread_begin_warns_that_sigterm_is_not_handled_here(
    caplog: pytest.LogCaptureFixture,
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not taskpoint's (an earlier test's)
    stop = PreemptionStop(timeout=30, agreement=lambda _timeout: Alone())
    began: list[bool] = []
    with caplog.at_level("WARNING", logger="taskpoint.runtime.preemption_stop"):
        worker = threading.Thread(target=lambda: began.append(stop.begin()))
        worker.start()
        worker.join()
    try:
        assert began == [False] and stop.active  # the vote still runs: another rank's signal
        assert "not in the main thread, so taskpoint cannot handle SIGTERM" in caplog.text
    finally:
        stop.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="taskpoint.runtime.preemption_stop"):
        assert stop.begin()  # in the main thread: no warning
    stop.close()
    assert "main thread" not in caplog.text

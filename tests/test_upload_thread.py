"""One coalescing upload worker: a checkpoint's background saves, a folder mirror's own
uploads and the PyTorch adapter's state saves all run on ``UploadThread``, whose contract
(one running, one pending, the newest wins and is told how many it replaced) is tested
here once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from taskpoint import Checkpoint, preemption
from taskpoint.checkpoint._upload_thread import UploadThread
from taskpoint.checkpoint.mirror import FolderMirror


class Plain:
    """Another system's checkpoint: no ``wait``, so a mirror uploads on its own thread."""

    def save_sync(self, data: object) -> None: ...

    async def save(self, data: object) -> None: ...

    def load_sync(self) -> None: ...

    async def load(self) -> None: ...


def test_checkpoints_and_mirrors_share_one_upload_worker(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "store")
    assert type(checkpoint._saves._background) is UploadThread
    assert type(FolderMirror(Plain(), blocking=False)._worker) is UploadThread


def _held(thread: UploadThread) -> threading.Event:
    """Start a job that runs until the returned event is set."""
    gate, started = threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        assert gate.wait(30)

    thread.start(job)
    assert started.wait(30)
    return gate


def test_the_newest_pending_job_runs_and_is_told_how_many_it_replaced() -> None:
    thread = UploadThread("test-upload", nice=False)
    gate = _held(thread)
    ran: list[tuple[str, int]] = []
    dropped: list[str] = []
    for name in ("a", "b", "c"):
        thread.start(
            lambda name=name: ran.append((name, thread.replaced)),  # type: ignore[misc]
            on_drop=lambda name=name: dropped.append(name),  # type: ignore[misc]
        )
    thread.note_coalesced(2)  # replaced on another thread, before they reached this one
    gate.set()
    assert thread.wait(30)
    assert ran == [("c", 4)] and dropped == ["a", "b"]
    assert thread.coalesced == 2 and not thread.busy


def test_a_save_outside_the_thread_takes_the_count_and_supersedes_older_tickets() -> None:
    thread = UploadThread("test-upload", nice=False)
    gate = _held(thread)
    ran: list[int] = []
    thread.start(lambda: ran.append(1), ticket=1)
    thread.start(lambda: ran.append(2), ticket=2)  # replaces 1
    assert not thread.supersede(2)  # ticket 2 is not older than itself
    assert thread.supersede(3)  # a blocking save with ticket 3 started: 2 goes
    assert thread.take_coalesced() == 2 and thread.take_coalesced() == 0
    assert not thread.drop_pending()  # nothing pending now
    gate.set()
    assert thread.wait(30) and ran == []


def test_a_job_pending_while_none_runs_is_not_dropped() -> None:
    thread = UploadThread("test-upload", nice=False)
    with thread._cond:  # the thread cannot take the job yet
        thread.start(lambda: None)
        assert not thread.drop_pending()
    assert thread.wait(30)


def test_a_failed_job_is_kept_by_idle_and_raised_once_by_wait() -> None:
    thread = UploadThread("test-upload", nice=False)

    def fail() -> None:
        raise RuntimeError("upload failed")

    thread.start(fail)
    assert thread.idle(30)
    assert thread.idle(30)  # still kept
    with pytest.raises(RuntimeError, match="upload failed"):
        thread.wait(30)
    assert thread.wait(30) and thread.take_error() is None


def _stoppable(thread: UploadThread) -> tuple[threading.Event, list[str]]:
    """Start a job, stoppable by its ``stop`` function, that runs until the returned event
    is set (as stopping it does); ``stops`` records the calls of its stop function."""
    gate, started = threading.Event(), threading.Event()
    stops: list[str] = []

    def job() -> None:
        started.set()
        assert gate.wait(30)

    def stop() -> None:
        stops.append("stopped")
        gate.set()

    thread.start(job, stop=stop)
    assert started.wait(30)
    return gate, stops


@pytest.mark.parametrize("preempted", [False, True], ids=["idle", "after-a-preemption-signal"])
def test_a_wait_stops_the_running_job_for_a_pending_one_unless_preempted(
    preempted: bool,
) -> None:
    """The newest goes first: a wait stops a running job that can be stopped when a newer
    one waits behind it. Not after a preemption signal: the grace period may fit the rest
    of the running upload and not a whole new one."""
    thread = UploadThread("test-upload", nice=False)
    gate, stops = _stoppable(thread)
    ran: list[str] = []
    thread.start(lambda: ran.append("newer"))
    if preempted:
        preemption.relay(300.0)
        threading.Timer(0.5, gate.set).start()  # the running job ends on its own
    try:
        assert thread.wait(30)
    finally:
        preemption.reset()
    assert stops == ([] if preempted else ["stopped"])
    assert ran == ["newer"]


def test_a_wait_stops_nothing_when_no_job_is_pending() -> None:
    thread = UploadThread("test-upload", nice=False)
    gate, stops = _stoppable(thread)
    threading.Timer(0.5, gate.set).start()
    assert thread.wait(30)
    assert stops == []


def test_a_wait_waits_for_a_running_job_to_hand_over_its_stop() -> None:
    """A job that hands its save over to a checkpoint says then how to stop it; a wait
    that comes first waits for that, then stops it for the job pending."""
    thread = UploadThread("test-upload", nice=False)
    started, handed, release = threading.Event(), threading.Event(), threading.Event()
    stops: list[str] = []

    def job() -> None:
        started.set()
        assert handed.wait(30)  # serialising, say
        thread.hand_over(stop=lambda: (stops.append("stopped"), release.set()))
        assert release.wait(30)  # the upload it handed over, until it commits or stops

    thread.start(job)
    assert started.wait(30)  # running, not pending (a newer start would replace it)
    thread.start(lambda: None)
    threading.Timer(0.5, handed.set).start()
    assert thread.wait(30)
    assert stops == ["stopped"]

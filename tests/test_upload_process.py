"""Background saves upload from a separate process, never holding the training loop's GIL."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest
import taskpoint
from taskpoint import Checkpoint, CheckpointClosedError, CheckpointError, SaveStats
from taskpoint.checkpoint import _uploader


def _upload_pid(timeout: float = 60.0) -> int:
    """The pid of this process's upload process, once it is ready (started if need be)."""
    worker = _uploader.shared()
    assert worker.wait_ready(timeout), "no upload process started"
    pid = worker.pid
    assert pid is not None
    return pid


def _sent(ckpt: Checkpoint, count: int, timeout: float = 60.0) -> None:
    """Wait until ``ckpt`` has handed ``count`` saves to the upload process."""
    deadline = time.monotonic() + timeout
    while ckpt._saves.process_uploads < count:
        assert time.monotonic() < deadline, "the save never reached the upload process"
        time.sleep(0.001)


def _tree(root: Path, mb: int, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "weights.bin").write_bytes(os.urandom(mb * 2**20))
    (root / "step.txt").write_text(str(seed))
    return root


def test_background_saves_upload_in_another_process_and_commit_in_order(
    store_url: str, tmp_path: Path
) -> None:
    if store_url.startswith("memory://"):
        pytest.skip("memory:// lives in one process: its background saves use a thread")
    # when_busy="wait": every save commits, in order (under "coalesce" the blocking third
    # save would stop the second's upload: tests/test_save_goes_first.py)
    ckpt = Checkpoint(store_url, keep=3, background_upload="process", when_busy="wait")
    stats: list[SaveStats] = []
    ckpt.on_commit(stats.append)
    pid = _upload_pid()
    assert pid != os.getpid()
    first = _tree(tmp_path / "first", 8, seed=1)
    ckpt.save_sync(first, background=True)
    os.kill(pid, 0)  # alive
    ckpt.wait()
    ckpt.save_sync(_tree(tmp_path / "second", 16, seed=2), background=True)
    _sent(ckpt, 2)  # until the upload is in flight (a queued one would be superseded)
    ckpt.save_sync(b"third")  # waits for the upload in flight, then commits after it
    ckpt.wait()
    assert [(s.seq, s.kind, s.background) for s in stats] == [
        (0, "directory", True), (1, "directory", True), (2, "bytes", False),
    ]
    assert all(s.blocked_s <= s.save_s and s.uploaded == s.size for s in stats)
    assert ckpt._saves.process_uploads == 2
    assert _uploader.shared().pid == pid  # the same process uploaded both
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None and restored.read_bytes() == b"third"
    assert [m.seq for m in Checkpoint(store_url).committed()] == [2, 1, 0]


def _thread_nices(pid: int) -> set[int]:
    """The nice values of ``pid``'s threads now (Linux's ``/proc``)."""
    nices = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
        nices.add(int(fields[16]))  # the 19th field of stat: nice
    return nices


def test_the_upload_process_runs_at_the_training_loops_priority_by_default(
    tmp_path: Path,
) -> None:
    ckpt = Checkpoint(tmp_path / "store", background_upload="process")
    ckpt.save_sync(b"x", background=True)
    pid = _upload_pid()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        assert os.getpriority(os.PRIO_PROCESS, pid) == base
        # the start-up thread (at STARTUP_NICE) may still be ending when the child says
        # ready; every thread that stays runs at the training loop's priority
        deadline = time.monotonic() + 10
        while (nices := _thread_nices(pid)) != {base} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert nices == {base}
    finally:
        ckpt.wait()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_upload_nice_lowers_a_background_upload_but_never_a_preemption_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKPOINT_UPLOAD_NICE", "7")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    ckpt = Checkpoint(tmp_path / "store", keep=5, background_upload="process")
    pid = _upload_pid()  # started with this environment
    ckpt.save_sync(b"warm", background=True)
    ckpt.wait()

    def nices_while_uploading(tree: Path) -> set[int]:
        sent = ckpt._saves.process_uploads
        ckpt.save_sync(tree, background=True)
        _sent(ckpt, sent + 1)
        seen: set[int] = set()
        while ckpt._saves._background.busy:
            seen |= _thread_nices(pid)
            time.sleep(0.001)
        ckpt.wait()
        return seen

    assert min(base + 7, 19) in nices_while_uploading(_tree(tmp_path / "a", 64, seed=1))
    taskpoint.preemption.relay(60.0)
    try:
        assert nices_while_uploading(_tree(tmp_path / "b", 64, seed=2)) == {base}
    finally:
        taskpoint.preemption.reset()
    assert os.getpriority(os.PRIO_PROCESS, pid) == base


def test_thread_mode_still_available(tmp_path: Path) -> None:
    ckpt = Checkpoint(tmp_path / "store", background_upload="thread")
    ckpt.save_sync(b"x", background=True)
    ckpt.wait()
    assert ckpt._saves.process_uploads == 0
    with pytest.raises(ValueError, match="background_upload"):
        Checkpoint(tmp_path / "store", background_upload="fork")


def test_a_killed_upload_process_fails_that_save_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ckpt = Checkpoint(store, keep=5, background_upload="process")
    ckpt.save_sync(b"committed before")
    pid = _upload_pid()
    ckpt.save_sync(_tree(tmp_path / "big", 64), background=True)
    _sent(ckpt, 1)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"upload process died.*SIGKILL"):
        ckpt.wait()
    restored = Checkpoint(store).load_sync()
    assert restored is not None and restored.read_bytes() == b"committed before"
    ckpt.save_sync(b"after", background=True)  # a thread, while a fresh process starts
    ckpt.wait()
    assert _uploader.shared().wait_ready(60) and _uploader.shared().pid != pid
    restored = Checkpoint(store).load_sync()
    assert restored is not None and restored.read_bytes() == b"after"


def test_the_upload_process_ignores_sigterm_and_finishes_its_upload(tmp_path: Path) -> None:
    """A preempted attempt waits for the upload in flight: SIGTERM, sent to the whole
    process group by launchers, must not kill it half-way."""
    store = tmp_path / "store"
    ckpt = Checkpoint(store, background_upload="process")
    pid = _upload_pid()
    ckpt.save_sync(_tree(tmp_path / "big", 64), background=True)
    _sent(ckpt, 1)
    os.kill(pid, signal.SIGTERM)
    ckpt.wait()
    restored = Checkpoint(store).load_sync()
    assert restored is not None and (restored / "weights.bin").stat().st_size == 64 * 2**20
    assert _uploader.shared().pid == pid


def _upload_processes() -> dict[int, int]:
    """This process's upload processes, read from ``/proc``: pid to resident memory (bytes)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
            status = (entry / "status").read_text()
        except OSError:  # it ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid != os.getpid() or _uploader.CHILD_MODULE.encode() not in cmdline:
            continue
        rss = [line for line in status.splitlines() if line.startswith("VmRSS:")]
        found[int(entry.name)] = int(rss[0].split()[1]) * 1024 if rss else 0
    return found


def test_two_hundred_checkpoints_share_one_upload_process(tmp_path: Path) -> None:
    """Each of 200 checkpoints makes a background save through the upload process; some
    are closed, the others dropped. Never more than one upload process runs, and its
    memory stays bounded."""
    assert _uploader.shared().wait_ready(60)
    deadline = time.monotonic() + 60
    while len(_upload_processes()) > 1:  # one an earlier test's environment started, exiting
        assert time.monotonic() < deadline, _upload_processes()
        time.sleep(0.05)
    saved_in_process = 0
    peak = 0
    for i in range(200):
        ckpt = Checkpoint(tmp_path / "store" / str(i), background_upload="process")
        ckpt.save_sync(_tree(tmp_path / "tree" / str(i), 0, seed=i), background=True)
        if i % 2:
            ckpt.close()
        else:
            ckpt.wait()
        saved_in_process += ckpt._saves.process_uploads
        peak = max(peak, len(_upload_processes()))
        del ckpt
    gc.collect()
    alive = _upload_processes()
    assert peak <= 1 and len(alive) <= 1, alive
    assert saved_in_process == 200  # the upload process did the work, not a thread
    assert sum(alive.values()) < 200 * 2**20, alive  # one interpreter, not two hundred
    restored = Checkpoint(tmp_path / "store" / "199").load_sync()
    assert restored is not None and (restored / "step.txt").read_text() == "199"


def test_close_waits_for_the_save_in_flight_and_ends_saving(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with Checkpoint(store, background_upload="process") as ckpt:
        ckpt.save_sync(_tree(tmp_path / "big", 32), background=True)
    restored = Checkpoint(store).load_sync()  # committed before the with block ended
    assert restored is not None and (restored / "weights.bin").stat().st_size == 32 * 2**20
    ckpt.close()  # again: nothing to do
    with pytest.raises(CheckpointClosedError, match=r"Checkpoint\(.*was closed"):
        ckpt.save_sync(b"late")
    with pytest.raises(CheckpointClosedError):
        ckpt.save_sync(b"late", background=True)
    assert ckpt.load_sync() is not None  # loading still works
    assert ckpt.closed and not pickle.loads(pickle.dumps(ckpt)).closed  # a copy is open


def test_a_block_that_raises_still_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with pytest.raises(RuntimeError, match="training failed"), Checkpoint(store) as ckpt:
        ckpt.save_sync(_tree(tmp_path / "big", 16, seed=3), background=True)
        raise RuntimeError("training failed")
    assert ckpt.closed
    restored = Checkpoint(store).load_sync()
    assert restored is not None and (restored / "step.txt").read_text() == "3"


def test_close_raises_what_the_last_background_save_raised(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ckpt = Checkpoint(store, background_upload="thread")
    (tmp_path / "tree").mkdir()
    ckpt.save_sync(tmp_path / "tree", background=True)
    ckpt.wait()
    store.rename(tmp_path / "moved")
    store.write_text("a file where the store's folder was")
    ckpt.save_sync(tmp_path / "tree", background=True)
    with pytest.raises(CheckpointError):
        ckpt.close()
    ckpt.close()  # closed all the same
    with pytest.raises(CheckpointClosedError):
        ckpt.save_sync(b"late")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _ended_within(worker: _uploader.Worker, pid: int, thread: object, timeout: float) -> float:
    """Seconds until the upload process ``pid`` and its reader ``thread`` have ended."""
    started = time.monotonic()
    while _alive(pid) or thread in threading.enumerate():
        assert time.monotonic() - started < timeout, "the idle upload process still runs"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_an_upload_process_no_open_checkpoint_uses_ends_once_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an open checkpoint uses it the upload process stays, idle or not; once the
    last is closed (or collected) it ends after IDLE_EXIT_S seconds, reader thread too,
    and the next background save starts a new one."""
    monkeypatch.setattr(_uploader, "_shared", None)  # this test's own upload process
    # A 3 s idle wait, not the 10 s default: the rules are the same, each wait shorter.
    monkeypatch.setattr(_uploader, "IDLE_EXIT_S", 3.0)
    gc.collect()
    ckpt = Checkpoint(tmp_path / "store", background_upload="process")
    assert ckpt.load_sync() is None  # a job loads first: that starts it for the saves
    pid = _upload_pid()
    ckpt.save_sync(b"x", background=True)
    ckpt.wait()
    assert ckpt._saves.process_uploads == 1
    thread = _uploader.shared().thread
    assert thread is not None and thread.daemon and callable(getattr(thread, "stop", None))
    time.sleep(_uploader.IDLE_EXIT_S + 2)
    assert _alive(pid), "an open checkpoint still uses it"
    ckpt.close()
    took = _ended_within(_uploader.shared(), pid, thread, _uploader.IDLE_EXIT_S + 30)
    assert took >= _uploader.IDLE_EXIT_S - 1  # it waited for a new user first

    dropped = Checkpoint(tmp_path / "store", background_upload="process", keep=3)
    # y starts a new upload process, and goes through a thread if that is not ready yet
    dropped.save_sync(b"y", background=True)
    dropped.wait()
    pid = _upload_pid()
    sent = dropped._saves.process_uploads
    dropped.save_sync(b"z", background=True)
    dropped.wait()
    assert dropped._saves.process_uploads == sent + 1  # through the new upload process
    thread = _uploader.shared().thread
    del dropped  # never closed: collected
    gc.collect()
    _ended_within(_uploader.shared(), pid, thread, _uploader.IDLE_EXIT_S + 30)
    restored = Checkpoint(tmp_path / "store").load_sync()
    assert restored is not None and restored.read_bytes() == b"z"


def test_stopping_the_reader_thread_ends_the_upload_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a test harness stopping left-over daemon threads does (Lightning's calls a
    daemon thread's ``stop``): the upload process ends at once, a later save starts anew."""
    monkeypatch.setattr(_uploader, "_shared", None)
    ckpt = Checkpoint(tmp_path / "store", background_upload="process")
    pid = _upload_pid()
    ckpt.save_sync(b"x", background=True)
    ckpt.wait()
    thread = _uploader.shared().thread
    assert thread is not None
    started = time.monotonic()
    thread.stop()  # type: ignore[attr-defined]
    assert not thread.is_alive() and not _alive(pid)
    assert time.monotonic() - started < _uploader.IDLE_EXIT_S
    ckpt.save_sync(b"y", background=True)
    ckpt.close()
    assert Checkpoint(tmp_path / "store").load_sync().read_bytes() == b"y"  # type: ignore[union-attr]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_release_ends_the_upload_process_at_once_and_the_next_save_takes_it_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Checkpoint.release`` (the adapters' end of training) lets go of the upload process
    without closing: once no open checkpoint holds it, it ends at once, reader thread too,
    and the next background save through the same checkpoint takes it up again."""
    monkeypatch.setattr(_uploader, "_shared", None)
    ckpt = Checkpoint(tmp_path / "store", background_upload="process")
    other = Checkpoint(tmp_path / "other", background_upload="process")
    pid = _upload_pid()
    ckpt.save_sync(b"x", background=True)
    ckpt.wait()
    assert ckpt._saves.process_uploads == 1
    thread = _uploader.shared().thread
    ckpt.release()
    time.sleep(_uploader.IDLE_POLL_S * 4)
    assert _alive(pid) and thread in threading.enumerate(), "another open checkpoint uses it"
    other.release()
    took = _ended_within(_uploader.shared(), pid, thread, _uploader.IDLE_EXIT_S + 30)
    assert took < _uploader.IDLE_EXIT_S / 2  # not a closed checkpoint's idle wait
    assert not ckpt.closed and not other.closed

    # y starts a new upload process, and goes through a thread if that is not ready yet
    ckpt.save_sync(b"y", background=True)
    ckpt.wait()
    pid = _upload_pid()
    sent = ckpt._saves.process_uploads
    ckpt.save_sync(b"z", background=True)
    ckpt.wait()
    assert ckpt._saves.process_uploads == sent + 1  # through the new upload process
    thread = _uploader.shared().thread
    ckpt.release()
    assert _ended_within(_uploader.shared(), pid, thread, 30) < _uploader.IDLE_EXIT_S / 2
    assert Checkpoint(tmp_path / "store").load_sync().read_bytes() == b"z"  # type: ignore[union-attr]
    ckpt.close()
    ckpt.release()  # closed: nothing to let go of


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_a_released_upload_process_ends_once_the_save_in_flight_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Released with a save in flight, the upload process answers it (the save commits)
    and then ends; the save, begun before the release, does not take it up again."""
    monkeypatch.setattr(_uploader, "_shared", None)
    ckpt = Checkpoint(tmp_path / "store", background_upload="process")
    pid = _upload_pid()
    thread = _uploader.shared().thread
    os.kill(pid, signal.SIGSTOP)  # the request waits, unanswered, in its input
    try:
        ckpt.save_sync(_tree(tmp_path / "tree", 1, seed=7), background=True)
        _sent(ckpt, 1)
        ckpt.release()
        time.sleep(_uploader.IDLE_POLL_S * 4)
        assert not ckpt.wait(0) and thread in threading.enumerate()
    finally:
        os.kill(pid, signal.SIGCONT)
    ckpt.wait()
    assert _ended_within(_uploader.shared(), pid, thread, 30) < _uploader.IDLE_EXIT_S / 2
    restored = Checkpoint(tmp_path / "store").load_sync()
    assert restored is not None and (restored / "step.txt").read_text() == "7"


def test_a_relative_path_names_the_folder_of_the_working_directory_when_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload process is started once, in the working directory of its first save; a
    checkpoint made later with a relative path, after a chdir, commits to that path under
    the directory it was made in, where its loads look, not under the upload process's."""
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir()
    later.mkdir()
    monkeypatch.chdir(first)
    with taskpoint.Checkpoint.at("warm") as warm:  # starts the upload process here
        warm.save_sync(b"w", background=True)
        assert warm.wait(60) and _uploader.shared().wait_ready(60)
        monkeypatch.chdir(later)
        ckpt = taskpoint.Checkpoint.at("runs/job")
        ckpt.save_sync(b"y", background=True)
        assert ckpt.wait(60)
        restored = ckpt.load_sync()
        assert restored is not None and restored.read_bytes() == b"y"
        assert (later / "runs" / "job" / "checkpoints").is_dir()
        assert not (first / "runs").exists()
        assert ckpt.url == str(later / "runs" / "job")
        ckpt.close()
    assert taskpoint.Checkpoint.at("file://runs/job").url == f"file://{later}/runs/job"
    assert taskpoint.Checkpoint.at("memory://runs/job").url == "memory://runs/job"

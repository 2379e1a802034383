"""Scratch folders on the local disk outlive no process using them. A restore folder in the
temporary directory is removed at exit, and after a SIGKILL (which runs no exit handler)
by the next load of any process; a background save's snapshot beside what it snapshots,
left by a training process and its upload process killed together, by the next snapshot
taken there. (A snapshot whose training process alone was killed is the upload process's
to remove: ``tests/test_inflight.py``.) The same goes for an object an object-store read
downloaded whole first.

Real processes on one machine, as retries with ``isolation="process"`` or a scheduler that
requeues on the same node run them: one SIGKILLed after its load, one still alive, one
that loads after both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
import taskpoint
from _servers import ObjectServer
from taskpoint import _scratch
from taskpoint.store.store import Store

LOADER = textwrap.dedent(
    """
    import os, signal, sys
    import taskpoint
    path = taskpoint.Checkpoint(sys.argv[1]).load_sync()
    assert path is not None and path.read_bytes() == b"weights", path
    print(path, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2] == "hold":
        sys.stdin.read()  # until the test closes it
    """
)


def _folder(restored: str) -> Path:
    """The ``taskpoint-restore-*`` folder a restored path lies in."""
    path = Path(restored)
    while not path.name.startswith(_scratch.PREFIX):
        path = path.parent
    return path


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory of its own, for this process and the ones it starts."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_killed_process_restore_folder_goes_with_the_next_load(
    tmp_path: Path, scratch: Path
) -> None:
    store = str(tmp_path / "store")
    taskpoint.Checkpoint(store).save_sync(b"weights")
    run = [sys.executable, "-c", LOADER, store]

    killed = subprocess.run([*run, "kill"], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    dead = _folder(killed.stdout.strip())
    assert dead.is_dir(), "a SIGKILL runs no exit handler: its folder is left"
    older = scratch / f"{_scratch.PREFIX}older"  # no owner file: an older taskpoint's
    older.mkdir()

    holder = subprocess.Popen([*run, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        alive = _folder(holder.stdout.readline().strip())
        later = subprocess.run([*run, "exit"], capture_output=True, text=True, timeout=120)
        assert later.returncode == 0, later.stderr
        assert not dead.exists(), "the dead process's folder was not removed"
        assert alive.is_dir(), "a live process's folder was removed"
        assert older.is_dir()
        assert not _folder(later.stdout.strip()).exists(), "removed at its own exit"
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
    assert not alive.exists()
    assert sorted(p.name for p in scratch.iterdir() if p.name.startswith(_scratch.PREFIX)) == [
        older.name
    ]


SLOW_EXEC = textwrap.dedent(
    """
    import os, subprocess, sys, time
    import taskpoint

    spawn = subprocess.Popen
    forked, fork_seen = os.pipe()

    def in_the_child():
        os.write(fork_seen, b"x")
        time.sleep(1.5)  # between its fork and its exec

    def late_and_slow(*args, **kwargs):
        # A loaded machine: the thread starting the upload process forks only once the
        # restore folder exists, and the child is slow to exec.
        time.sleep(0.5)
        return spawn(*args, preexec_fn=in_the_child, **kwargs)

    subprocess.Popen = late_and_slow
    path = taskpoint.Checkpoint(sys.argv[1]).load_sync()
    assert path is not None and path.read_bytes() == b"weights", path
    os.read(forked, 1)  # the upload process is forked, not yet exec'd: exit now
    print(path, flush=True)
    """
)


def test_an_exit_while_the_upload_process_starts_still_removes_the_restore_folder(
    tmp_path: Path, scratch: Path
) -> None:
    """The load starts the upload process from a thread; the script ends before that
    process has run exec, so it still holds copies of the owner locks when exit comes."""
    store = str(tmp_path / "store")
    taskpoint.Checkpoint(store).save_sync(b"weights")
    done = subprocess.run(
        [sys.executable, "-c", SLOW_EXEC, store], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert not _folder(done.stdout.strip()).exists(), "left behind at its own exit"


FORKER = textwrap.dedent(
    """
    import os, sys
    import taskpoint
    path = taskpoint.Checkpoint(sys.argv[1]).load_sync()
    if os.fork() == 0:
        sys.exit(0)  # the child ends as a script does: its exit handlers run
    _, status = os.wait()
    assert os.waitstatus_to_exitcode(status) == 0
    assert path.read_bytes() == b"weights", "the child's exit removed its parent's restore"
    print(path, flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_leaves_its_parents_restore_folder_at_its_exit(
    tmp_path: Path, scratch: Path
) -> None:
    store = str(tmp_path / "store")
    taskpoint.Checkpoint(store).save_sync(b"weights")
    run = subprocess.run(
        [sys.executable, "-c", FORKER, store], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert not _folder(run.stdout.strip()).exists(), "removed at the parent's exit"


OUTLIVED = textwrap.dedent(
    """
    import os, sys
    import taskpoint
    path = taskpoint.Checkpoint(sys.argv[1]).load_sync()
    if os.fork() == 0:
        sys.stdin.read()  # until the test closes it, after the parent has exited
        print("child read", path.read_bytes() == b"weights", flush=True)
        sys.exit(0)
    print(path, flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_restore_folder_outlives_its_parent_while_a_forked_child_reads_it(
    tmp_path: Path, scratch: Path
) -> None:
    """The parent exits first (a data-loader worker outliving it, say): its exit leaves the
    folder to the child, whose exit leaves it in turn (it is not the child's); the next
    load on the machine removes it."""
    store = str(tmp_path / "store")
    taskpoint.Checkpoint(store).save_sync(b"weights")
    parent = subprocess.Popen(
        [sys.executable, "-c", OUTLIVED, store],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert parent.stdin is not None and parent.stdout is not None
    folder = _folder(parent.stdout.readline().strip())
    assert parent.wait(timeout=120) == 0
    assert folder.is_dir(), "removed at the parent's exit under a child still using it"
    parent.stdin.close()
    assert parent.stdout.read().strip() == "child read True"  # the pipe ends as the child does
    assert folder.is_dir()
    later = subprocess.run(
        [sys.executable, "-c", LOADER, store, "exit"], capture_output=True, text=True, timeout=120
    )
    assert later.returncode == 0, later.stderr
    assert not folder.exists(), "the next load did not remove a folder nobody holds"


KILLED_MID_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import taskpoint
    ckpt = taskpoint.Checkpoint(sys.argv[1])
    ckpt.save_sync(Path(sys.argv[2]), background=True, snapshot="link")
    os.killpg(0, signal.SIGKILL)  # the training process and its upload process, at once
    """
)


def test_a_killed_jobs_link_snapshot_goes_with_the_next_snapshot_beside_it(
    tmp_path: Path, scratch: Path
) -> None:
    """A job killed with its upload process right after a background save leaves the
    save's hard-linked snapshot in its own output folder; the next background save from
    that folder removes it, and keeps a snapshot a live process holds there."""
    out = tmp_path / "out"
    out.mkdir()
    weights = out / "weights.bin"
    weights.write_bytes(b"w" * (2 << 20))  # large enough to be linked, not copied
    store = str(tmp_path / "store")
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SAVE, store, str(weights)], capture_output=True,
        text=True, timeout=120, start_new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = list(out.glob(f"{_scratch.SNAPSHOT_PREFIX}*"))
    assert len(left) == 1, "the killed save's snapshot was not left behind"
    held = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.stdout is not None
        alive = Path(held.stdout.readline().strip())
        ckpt = taskpoint.Checkpoint(store)
        ckpt.save_sync(weights, background=True, snapshot="link")
        ckpt.wait()
        assert not left[0].exists(), "the dead job's snapshot was not removed"
        assert alive.is_dir(), "a live process's snapshot was removed"
        restored = ckpt.load_sync()
        assert restored is not None and restored.read_bytes() == weights.read_bytes()
    finally:
        held.communicate("", timeout=60)
    assert held.returncode == 0, "the live process's snapshot went from under it"
    assert not list(out.glob(f"{_scratch.SNAPSHOT_PREFIX}*")), "removed at their ends"


HOLDER = textwrap.dedent(
    """
    import sys
    from taskpoint import _scratch
    folder = _scratch.owned_folder(_scratch.SNAPSHOT_PREFIX, sys.argv[1])
    print(folder, flush=True)
    sys.stdin.read()  # until the test closes it
    assert folder.is_dir()
    """
)


DOWNLOADER = textwrap.dedent(
    """
    import os, signal, sys
    from taskpoint.store.store import Store
    with Store(sys.argv[1]).open_read("blob") as blob:  # downloaded whole first
        assert blob.read() == b"downloaded"
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_readers_download_goes_with_the_next_load(
    tmp_path: Path, scratch: Path, s3_server: ObjectServer
) -> None:
    """An object read from an object store is downloaded whole into a folder of the
    temporary directory first; a reader killed while it reads leaves that folder, and the
    next load of any process removes it."""
    url = s3_server.url("taskpoint-tests", uuid.uuid4().hex)
    Store(url).write_atomic("blob", b"downloaded")
    taskpoint.Checkpoint(url).save_sync(b"weights")
    killed = subprocess.run(
        [sys.executable, "-c", DOWNLOADER, url], capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = list(scratch.glob(f"{_scratch.DOWNLOAD_PREFIX}*"))
    assert len(left) == 1, "the killed reader's download was not left behind"
    later = subprocess.run(
        [sys.executable, "-c", LOADER, url, "exit"], capture_output=True, text=True, timeout=120
    )
    assert later.returncode == 0, later.stderr
    assert not left[0].exists(), "the killed reader's download outlived the next load"


SPOOLER = textwrap.dedent(
    """
    import os, signal
    from taskpoint.store.transfer import Spool
    spool = Spool(4)  # past 4 bytes, on the disk
    spool.write(b"0123456789")
    spool.finish()
    print(spool.path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_killed_writers_spool_goes_with_the_next_scratch_folder_made_beside_it(
    scratch: Path,
) -> None:
    """A streamed write to an object store spools past its first part to the disk (a
    whole format-1 checkpoint); a writer killed then leaves it only until the next scratch
    folder any process makes in that directory."""
    killed = subprocess.run(
        [sys.executable, "-c", SPOOLER], capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    spool = Path(killed.stdout.strip())
    assert spool.read_bytes() == b"0123456789"
    assert spool.parent.parent == scratch
    assert spool.parent.name.startswith(_scratch.UPLOAD_PREFIX)
    mine = _scratch.scratch_folder()
    try:
        assert not spool.parent.exists(), "a dead writer's spool was kept"
        assert mine.parent == scratch and mine.name.startswith(_scratch.SCRATCH_PREFIX)
    finally:
        _scratch.remove(mine)
    assert not mine.exists()


ISOLATED = textwrap.dedent(
    """
    import sys, time
    import taskpoint

    env = taskpoint.TaskEnvironment(name="isolated", root=sys.argv[1])

    @env.task(isolation="process")
    def work(seconds: float) -> None:
        print("running", flush=True)
        time.sleep(seconds)

    if __name__ == "__main__":
        work(600.0)
    """
)


def test_a_killed_runners_attempt_folder_goes_with_the_next_scratch_folder(
    scratch: Path, tmp_path: Path
) -> None:
    """A process-isolated attempt's arguments and outcome pass through a folder of the
    runner's; a runner killed with its attempt leaves it only until the next scratch folder
    any process makes in that directory."""
    script = tmp_path / "isolated.py"
    script.write_text(ISOLATED)
    runner = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "store")], cwd=tmp_path,
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert runner.stdout is not None
        assert runner.stdout.readline().strip() == "running"
    finally:
        os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
    (left,) = [p for p in scratch.iterdir() if p.name.startswith(_scratch.SCRATCH_PREFIX)]
    assert (left / "spec.pkl").exists()
    mine = _scratch.scratch_folder()
    try:
        assert not left.exists(), "a dead runner's attempt folder was kept"
    finally:
        _scratch.remove(mine)

"""Restore folders in the temporary directory outlive no process: removed at exit, and
after a SIGKILL (which runs no exit handler) by the next load of any process.

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
from pathlib import Path

import pytest
import taskpoint
from taskpoint.checkpoint import _scratch

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

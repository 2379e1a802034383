"""A background save survives its process ending: killed right after it started (the first
save never waits for the upload process to start) or ending on an uncaught exception (exit
waits for the saves in flight before the interpreter's thread pools shut down)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from taskpoint import Checkpoint

SLOW_START = textwrap.dedent(
    """
    import os, time
    if os.environ.get("TASKPOINT_TEST_SLOW_CHILDREN_OF") == str(os.getppid()):
        time.sleep(300)  # a child of the training process: a very slow interpreter start
    """
)
"""A ``sitecustomize`` that makes every process the training process starts (its upload
process) take minutes to start, as a cold import from a network file system can."""

KILLED_AFTER_TWO_STEPS = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import taskpoint

    os.environ["TASKPOINT_TEST_SLOW_CHILDREN_OF"] = str(os.getpid())
    url, work = sys.argv[1], Path(sys.argv[2])
    tree = work / "tree"
    tree.mkdir()
    (tree / "weights.bin").write_bytes(b"w" * 100_000)
    (tree / "step.txt").write_text("1")
    ckpt = taskpoint.Checkpoint(url)  # background saves upload from a process by default
    ckpt.save_sync(tree, background=True)
    for step in (2, 3):
        time.sleep(1.0)  # a training step
        (work / f"step-{step}").write_text("")
    time.sleep(600)
    """
)


def test_the_first_background_save_commits_while_the_upload_process_starts(
    tmp_path: Path,
) -> None:
    """The first background save, whose upload process takes minutes to start, has
    committed two steps later: a SIGKILL of the whole process group then loses nothing."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_START)
    url = f"file://{tmp_path / 'store'}"
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_AFTER_TWO_STEPS, url, str(work)],
        env=env, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (work / "step-3").exists():
            assert child.poll() is None, f"the training process ended ({child.returncode})"
            assert time.monotonic() < deadline, "the training process never reached step 3"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the training process and its upload process
        child.wait()
    restored = Checkpoint(url).load_sync()
    assert restored is not None, "the first background save was lost"
    assert (restored / "step.txt").read_text() == "1"
    assert (restored / "weights.bin").stat().st_size == 100_000


RAISES_AFTER_SAVE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import taskpoint
    from taskpoint.checkpoint.mirror import FolderMirror

    url, how, tree = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    tree.mkdir()
    for i in range(24):
        (tree / f"shard-{i}.bin").write_bytes(os.urandom(1 << 20))
    (tree / "step.txt").write_text("7")
    if how == "checkpoint-thread":
        ckpt = taskpoint.Checkpoint(url, background_upload="thread")
        ckpt.save_sync(tree, background=True)
    elif how == "mirror":
        FolderMirror(taskpoint.Checkpoint(url), blocking=False).save(tree, step=7)
    else:  # a multi-writer save, run on the mirror's own thread
        coordinator = taskpoint.StoreCoordinator(
            str(tree.parent / "coordination"), rank=0, world_size=1, session="s"
        )
        FolderMirror(taskpoint.Checkpoint(url), blocking=False).save_part(
            tree, coordinator=coordinator, step=7
        )
    raise RuntimeError("training failed")
    """
)


@pytest.mark.parametrize("how", ["checkpoint-thread", "mirror", "mirror-part"])
def test_a_save_in_flight_commits_when_training_raises(tmp_path: Path, how: str) -> None:
    """The process ends on an uncaught exception just after starting a background save of
    a tree big enough to be uploaded by a thread pool: exit waits for it, and it commits."""
    url = f"file://{tmp_path / 'store'}"
    child = subprocess.run(
        [sys.executable, "-c", RAISES_AFTER_SAVE, url, how, str(tmp_path / "tree")],
        capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == 1 and "RuntimeError: training failed" in child.stderr
    assert "after interpreter shutdown" not in child.stderr, child.stderr
    restored = Checkpoint(url).load_sync()
    assert restored is not None, f"the save in flight was lost:\n{child.stderr}"
    assert (restored / "step.txt").read_text() == "7"
    assert len(list(restored.glob("shard-*.bin"))) == 24

"""A background save survives its process ending: killed right after it started (the first
save never waits for the upload process to start) or ending on an uncaught exception (exit
waits for the saves in flight before the interpreter's thread pools shut down). That wait
is bounded: an upload that hangs is given up at its bound, and the attempt ends with the
checkpoint before it intact, saying so."""

from __future__ import annotations

import contextlib
import json
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


STALL_FS = textwrap.dedent(
    """
    import os, time
    from fsspec.implementations.local import LocalFileSystem

    class StallFileSystem(LocalFileSystem):
        \"\"\"The local disk, where writing a payload hangs once the file $STALL_FLAG
        exists: a store that stopped answering in the middle of an upload.\"\"\"

        protocol = ("stall",)

        def _open(self, path, mode="rb", *args, **kwargs):
            flag = os.environ.get("STALL_FLAG", "")
            if "w" in mode and str(path).endswith(".payload") and os.path.exists(flag):
                while True:
                    time.sleep(60)
            return super()._open(path, mode, *args, **kwargs)
    """
)
STALL_SITE = textwrap.dedent(
    """
    import os
    if os.environ.get("STALL_FLAG"):  # the training process and its upload process
        import fsspec
        fsspec.register_implementation("stall", "stallfs.StallFileSystem", clobber=True)
    """
)

FAILS_WITH_AN_UPLOAD_HUNG = textwrap.dedent(
    """
    import json, logging, os, signal, sys, time
    from pathlib import Path
    import taskpoint
    from taskpoint import preemption
    from taskpoint.checkpoint import _settle
    from taskpoint.runtime import step_boundary

    logging.basicConfig(level=logging.INFO)
    how, root, flag = sys.argv[1], sys.argv[2], Path(os.environ["STALL_FLAG"])
    if how == "exception":
        # Without a signal the attempt's end waits SETTLE_S and the exit EXIT_WAIT_S
        # (60 s each); this test cannot wait minutes, so both are shortened.
        step_boundary.SETTLE_S = _settle.EXIT_WAIT_S = float(os.environ["BOUND"])
    env = taskpoint.TaskEnvironment(name="hung", root=root, run_id="r")
    seen = {}

    @env.task(retries=0, isolation="inline")
    def train():
        ckpt = taskpoint.ctx().checkpoint
        ckpt.load_sync()
        taskpoint.report_step(5)
        started = time.monotonic()
        ckpt.save_sync(b"state at step 5")
        seen["save_s"] = time.monotonic() - started
        flag.touch()  # from now on the store never finishes writing a payload
        taskpoint.report_step(6)
        ckpt.save_sync(b"state at step 6", background=True)
        with preemption.deferred():
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # noted; the loop fails before it stops
            seen["raised"] = time.time()
            raise RuntimeError("lost a rank")

    try:
        train()
    except RuntimeError as exc:
        seen["error"] = str(exc)
    seen["attempt_s"] = time.time() - seen["raised"]
    print(json.dumps(seen), flush=True)
    """
)


@pytest.mark.parametrize("how", ["exception", "sigterm"])
def test_a_hung_upload_is_given_up_at_its_bound_and_the_checkpoint_before_it_stays(
    tmp_path: Path, how: str
) -> None:
    """A task fails while its background save hangs in the store. The attempt waits for
    that save only until its bound (a SIGTERM's grace period, else the settle bound), then
    ends and is recorded; the process exits by the same bound; the save before it loads,
    and the log (and, after a SIGTERM, the record) says the save did not commit."""
    from taskpoint.format.history import read_attempts
    from taskpoint.runtime.step_boundary import MARGIN_S
    from taskpoint.store.store import Store

    bound = 6.0
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALL_SITE)
    (site / "stallfs.py").write_text(STALL_FS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        STALL_FLAG=str(tmp_path / "stall"), BOUND=str(bound),
    )
    if how == "sigterm":
        env["TASKPOINT_GRACE_PERIOD"] = str(bound)
    root = tmp_path / "store"
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:  # files: the hung upload
        child = subprocess.Popen(  # process would hold pipes open
            [sys.executable, "-c", FAILS_WITH_AN_UPLOAD_HUNG, how, f"stall://{root}"],
            stdout=stdout, stderr=stderr, env=env, start_new_session=True,
        )
        try:
            child.wait(timeout=2 * bound + 120)  # far past both bounds: it hangs
            ended = time.time()
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process still ran {2 * bound + 120:.0f} s on:\n{err.read_text()}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # and the upload process, still hung
            child.wait()
    log = err.read_text()
    assert child.returncode == 0, log
    seen = json.loads(out.read_text())
    assert seen["error"] == "lost a rank"
    # The attempt waited for the upload (not abandoning it at once) up to its bound, then
    # ended; the exit waited again for it (without a signal) up to its own bound. The margin
    # is for writing the attempt's records and the interpreter's exit on a loaded machine,
    # each a few times what one small save took.
    waited = bound - MARGIN_S if how == "sigterm" else bound
    margin = 20 + 20 * seen["save_s"]
    assert waited / 2 <= seen["attempt_s"] <= waited + margin, (seen, log)
    exit_wait = 0.0 if how == "sigterm" else bound  # the grace period has run out by then
    assert ended - seen["raised"] <= waited + exit_wait + margin, (seen, log)
    assert "a background save had not committed after" in log, log
    assert "the newest checkpoint is the one before it" in log
    restored = Checkpoint(root / "hung.train" / "r").load_sync()
    assert restored is not None and restored.read_bytes() == b"state at step 5"
    (record,) = read_attempts(Store(str(root / "hung.train" / "r")))
    assert (record.outcome, record.step) == ("failed", 6)
    assert record.preemption_save == ("missed" if how == "sigterm" else None)

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
from _slow_store import slow_env
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


def _site_env(tmp_path: Path, modules: dict[str, str], **variables: str) -> dict[str, str]:
    """The environment of a child Python whose site folder (in ``tmp_path``) holds
    ``modules`` (file name to source; its ``sitecustomize.py`` runs as the child starts):
    this one's, without its ``TASKPOINT_`` settings, plus ``variables``."""
    site = tmp_path / "site"
    site.mkdir()
    for name, source in modules.items():
        (site / name).write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **variables
    )
    return env


@pytest.mark.parametrize("how", ["exception", "sigterm"])
def test_a_hung_upload_is_given_up_at_its_bound_and_the_checkpoint_before_it_stays(
    tmp_path: Path, how: str
) -> None:
    """A task fails while its background save hangs in the store. The attempt waits for
    that save only until its bound (a SIGTERM's grace period, else the settle bound), then
    ends and is recorded; the process exits by the same bound; the save before it loads,
    and the log (and, after a SIGTERM, the record) says the save did not commit."""
    from taskpoint.format.history import read_attempts
    from taskpoint.runtime.preemption_stop import MARGIN_S
    from taskpoint.store.store import Store

    bound = 6.0
    env = _site_env(
        tmp_path, {"sitecustomize.py": STALL_SITE, "stallfs.py": STALL_FS},
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


TERMINATED_WHILE_UPLOADING = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import taskpoint
    from taskpoint.checkpoint.mirror import FolderMirror

    how, url, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if how == "own-handler":
        signal.signal(signal.SIGTERM, lambda *_: (print("own handler", flush=True), os._exit(7)))
    state = work / "state.txt"  # a file: its upload goes through the store's writes
    state.write_text("5")
    ckpt = taskpoint.Checkpoint(url, background_upload="process" if how == "process" else "thread")
    ckpt.save_sync(state)
    Path(os.environ["SLOW_FLAG"]).touch()  # from now on every write to the store is slow
    state.write_text("6")
    if how == "mirror":
        FolderMirror(ckpt, blocking=False).save(state, step=6)
    else:
        ckpt.save_sync(state, background=True)
    (work / "uploading").touch()
    while True:  # training goes on until the launcher's SIGTERM
        time.sleep(0.01)
    """
)


@pytest.mark.parametrize("how", ["thread", "process", "mirror"])
def test_a_sigterm_nobody_handles_ends_the_process_once_the_save_in_flight_commits(
    tmp_path: Path, how: str
) -> None:
    """A process with no SIGTERM handler of its own (torchrun's survivors after one rank
    failed, a plain script) gets SIGTERM while a background save uploads: the signal still
    ends it (by SIGTERM), but only after the save committed, within the grace period."""
    slow_s, grace = 3.0, 30.0
    child, elapsed, log = _terminate_while_uploading(tmp_path, how, slow_s=slow_s, grace=grace)
    assert child.returncode == -signal.SIGTERM, log
    restored = Checkpoint(f"file://{tmp_path / 'store'}").load_sync()
    assert restored is not None and restored.read_text() == "6", log
    assert elapsed >= slow_s / 2, (elapsed, log)  # it did wait for the upload
    assert elapsed < grace, (elapsed, log)


def test_a_sigterm_ends_the_process_at_the_grace_periods_end_when_the_upload_is_slower(
    tmp_path: Path,
) -> None:
    """The upload in flight would take longer than the grace period: the signal ends the
    process by the grace period's end, and the checkpoint before it still loads."""
    grace = 3.0
    child, elapsed, log = _terminate_while_uploading(tmp_path, "thread", slow_s=60.0, grace=grace)
    assert child.returncode == -signal.SIGTERM, log
    assert grace / 2 <= elapsed <= grace + 15, (elapsed, log)
    restored = Checkpoint(f"file://{tmp_path / 'store'}").load_sync()
    assert restored is not None and restored.read_text() == "5", log


def test_a_sigterm_handler_of_the_programs_own_is_left_in_place(tmp_path: Path) -> None:
    """A program that handles SIGTERM itself keeps its handler: a background save does not
    replace it, and the signal does what the program says at once."""
    child, elapsed, log = _terminate_while_uploading(
        tmp_path, "own-handler", slow_s=60.0, grace=30.0
    )
    assert child.returncode == 7 and "own handler" in log, log
    assert elapsed < 15, (elapsed, log)


def _terminate_while_uploading(
    tmp_path: Path, how: str, *, slow_s: float, grace: float
) -> tuple[subprocess.Popen[bytes], float, str]:
    """Run :data:`TERMINATED_WHILE_UPLOADING`, send it SIGTERM once its save uploads; the
    process, seconds from the signal to its end, and its output."""
    env = slow_env(
        tmp_path, SLOW_FLAG=str(tmp_path / "slow"), SLOW_S=str(slow_s),
        TASKPOINT_GRACE_PERIOD=str(grace),
    )
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out.txt"
    with out.open("w") as output:  # a file: the upload process may outlive the child
        child = subprocess.Popen(
            [sys.executable, "-c", TERMINATED_WHILE_UPLOADING, how,
             f"slow://{tmp_path / 'store'}", str(work)],
            stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not (work / "uploading").exists():
                assert child.poll() is None, out.read_text()
                assert time.monotonic() < deadline, "the save never started"
                time.sleep(0.05)
            signalled = time.monotonic()
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=grace + 120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"SIGTERM did not end the process:\n{out.read_text()}")
            elapsed = time.monotonic() - signalled
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return child, elapsed, out.read_text()

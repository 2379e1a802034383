"""A retry on the same machine waits for the dead attempt's upload still in flight.

The upload process outlives a killed training process, commits its save and removes its
snapshot. A new process
restoring the same location first waits for that upload (at most the grace period), so it
restores the save its predecessor was committing; an upload process that dies mid-upload,
or one that hangs, never holds it past that bound."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _slow_store import slow_env as _env

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import taskpoint
    from taskpoint.checkpoint import _uploader

    url, work = sys.argv[1], Path(sys.argv[2])
    state = work / "state.txt"
    ckpt = taskpoint.Checkpoint(url)
    state.write_text("step 4")
    ckpt.save_sync(state)  # committed
    os.environ["SLOW_S"] = os.environ["UPLOAD_S"]  # the upload process, started now, is slow
    assert _uploader.shared().wait_ready(120), "the upload process did not start"
    state.write_text("step 8")
    ckpt.save_sync(state, background=True)  # sent to the upload process
    while True:  # training goes on until SIGKILL
        time.sleep(0.05)
    """
)
RETRY = textwrap.dedent(
    """
    import logging, sys, time
    import taskpoint

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    began = time.monotonic()
    path = taskpoint.Checkpoint(sys.argv[1]).load_sync()
    print(path.read_text() if path else "nothing", time.monotonic() - began, flush=True)
    """
)


def _snapshots(tmp_path: Path) -> list[str]:
    """The background saves' snapshots in the machine's temporary folder."""
    return sorted(p.name for p in (tmp_path / "tmp").glob(".taskpoint-snapshot-*"))


@contextlib.contextmanager
def _killed_while_uploading(tmp_path: Path, upload_s: float) -> Iterator[tuple[str, int]]:
    """Run :data:`TRAIN` until its second save's upload is in the store's first write,
    SIGKILL it there (its upload process goes on); the store URL and the upload process's
    id. The upload process is killed on the way out."""
    url = f"slow://{tmp_path / 'store'}"
    work = tmp_path / "work"
    work.mkdir()
    mark = tmp_path / "uploading"
    out = tmp_path / "train.txt"
    with out.open("w") as output:  # a file: the upload process outlives the child
        child = subprocess.Popen(
            [sys.executable, "-c", TRAIN, url, str(work)], stdout=output,
            stderr=subprocess.STDOUT, env=_env(tmp_path, UPLOAD_S=str(upload_s)),
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not mark.exists():
                assert child.poll() is None, out.read_text()
                assert time.monotonic() < deadline, "the background save never started"
                time.sleep(0.05)
            uploader = int(mark.read_text())
            assert uploader != child.pid, "the save uploaded from the training process"
            child.kill()  # SIGKILL, no warning
            child.wait()
            yield url, uploader
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the upload process, if it still runs
            child.wait()


def _retry(tmp_path: Path, url: str, grace: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RETRY, url], stdout=subprocess.PIPE,
        stderr=(tmp_path / "retry.txt").open("w"), text=True,
        env=_env(tmp_path, TASKPOINT_GRACE_PERIOD=str(grace)),
    )


def _result(retry: subprocess.Popen[str], tmp_path: Path) -> tuple[str, float, str]:
    """What the retry restored, how long its load took (seconds), and its log."""
    out, _ = retry.communicate(timeout=600)
    log = (tmp_path / "retry.txt").read_text()
    assert retry.returncode == 0, log
    content, _, elapsed = out.strip().rpartition(" ")
    return content, float(elapsed), log


def _wait_for_line(path: Path, text: str, retry: subprocess.Popen[str], limit: float) -> None:
    deadline = time.monotonic() + limit
    while text not in path.read_text():
        if retry.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the retry never logged {text!r}:\n{path.read_text()}")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_retry_restores_the_save_the_killed_attempts_upload_process_commits(
    tmp_path: Path,
) -> None:
    """Killed while its save's upload is in flight, the attempt's upload process commits
    the save a few seconds later; a retry started at once restores that save, not the one
    before it."""
    upload_s = 2.0
    with _killed_while_uploading(tmp_path, upload_s) as (url, _):
        content, elapsed, log = _result(_retry(tmp_path, url, grace=300), tmp_path)
    assert content == "step 8", log
    assert "waiting up to 300.0 s for 1 upload(s)" in log, log
    assert elapsed < 200, log  # it waited for the commit, not to the bound
    deadline = time.monotonic() + 60
    while _snapshots(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _snapshots(tmp_path) == [], "the upload process left the dead attempt's snapshot"


@pytest.mark.slow
def test_an_upload_process_killed_mid_upload_ends_the_wait_at_once(tmp_path: Path) -> None:
    """The upload process dies mid-upload (its marker stays behind, unlocked): the waiting
    retry stops waiting then, long before its bound, and restores the save before."""
    with _killed_while_uploading(tmp_path, upload_s=600) as (url, uploader):
        retry = _retry(tmp_path, url, grace=300)
        _wait_for_line(tmp_path / "retry.txt", "waiting up to", retry, limit=120)
        killed = time.monotonic()
        os.kill(uploader, signal.SIGKILL)
        content, _, log = _result(retry, tmp_path)
        ended = time.monotonic()
    assert content == "step 4", log
    assert ended - killed < 60, log  # far below the 300 s bound
    assert "still in flight after" not in log, log
    assert _snapshots(tmp_path) == [], "the retry's load left the dead processes' snapshot"


@pytest.mark.slow
def test_a_hung_upload_holds_the_retry_no_longer_than_the_grace_period(tmp_path: Path) -> None:
    """The upload hangs (a store that never answers): the retry waits for it until the
    grace period's end, then restores the save before, saying so."""
    grace = 4.0
    with _killed_while_uploading(tmp_path, upload_s=600) as (url, _):
        content, elapsed, log = _result(_retry(tmp_path, url, grace=grace), tmp_path)
    assert content == "step 4", log
    assert "still in flight after 4.0 s" in log, log
    assert grace <= elapsed < grace + 60, log
    assert len(_snapshots(tmp_path)) == 1, "the retry's load removed a live upload's snapshot"


def test_a_marker_left_unlocked_is_removed_and_not_waited_for(tmp_path: Path) -> None:
    """In-process: a held marker is seen, by its URL's every spelling; once its holder
    ends (or if it died, leaving the file) it is not."""
    from taskpoint.checkpoint import _inflight

    url = str(tmp_path / "store")
    assert _inflight.in_flight(url) == []
    with _inflight.hold(f"file://{url}/"):
        seen = _inflight.in_flight(url)
        assert [(m.url, m.pid) for m in seen] == [(f"file://{url}/", os.getpid())]
        assert _inflight.in_flight(str(tmp_path / "other")) == []
    assert _inflight.in_flight(url) == []
    # A marker whose holder was killed: present, unlocked.
    left = _inflight.folder() / f"{_inflight._key(url)}.1.1.1.upload"
    left.write_text("{}")
    began = time.monotonic()
    assert _inflight.wait(url, timeout=30)
    assert time.monotonic() - began < 5
    assert not left.exists()

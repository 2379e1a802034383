"""``Checkpoint.prefetch``: a restore started ahead, taken by the next load.

A restarted job calls it before it builds its model; the download then runs while the
model is built, and ``load_sync`` hands over what it restored."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import taskpoint
from _slow_store import slow_env
from taskpoint import CheckpointCorruptError


def _prefetch_done(limit: float = 60.0) -> None:
    """Wait until no prefetch thread runs."""
    deadline = time.monotonic() + limit
    while any(t.name == "taskpoint-prefetch" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the prefetch never ended"
        time.sleep(0.01)


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "weights.bin").write_bytes(bytes(range(256)) * 512)
    (root / "sub" / "state.json").write_text('{"step": 7}')
    return root


def test_the_load_takes_what_the_prefetch_restored_before_the_store_went_away(
    tmp_path: Path,
) -> None:
    """Everything the load returns was fetched ahead: with the store moved away after the
    prefetch ended, the load still returns the tree; without the prefetch it finds none."""
    store = tmp_path / "store"
    taskpoint.Checkpoint(store).save_sync(_tree(tmp_path / "run"))
    ahead = taskpoint.Checkpoint(store, workdir=tmp_path / "restores")
    ahead.prefetch()
    _prefetch_done()
    store.rename(tmp_path / "elsewhere")
    restored = ahead.load_sync()
    assert restored is not None
    assert (restored / "weights.bin").read_bytes() == bytes(range(256)) * 512
    assert (restored / "sub" / "state.json").read_text() == '{"step": 7}'
    assert taskpoint.Checkpoint(store).load_sync() is None  # what a load finds there now


def test_nothing_committed_loads_none(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(tmp_path / "store")
    ckpt.prefetch()
    assert ckpt.load_sync() is None


def test_the_load_raises_what_the_prefetch_raised(tmp_path: Path) -> None:
    """A failing restore does not raise from ``prefetch``; the load that takes it does."""
    store = tmp_path / "store"
    taskpoint.Checkpoint(store).save_sync(b"state" * 1000)
    payload = next((store / "checkpoints").glob("*.payload"))
    payload.write_bytes(b"x" + payload.read_bytes()[1:])
    ckpt = taskpoint.Checkpoint(store)
    with pytest.warns(taskpoint.TaskpointWarning, match="skipping checkpoint"):
        ckpt.prefetch()
        _prefetch_done()
    with pytest.raises(CheckpointCorruptError, match="failed verification"):
        ckpt.load_sync()


def test_a_load_with_other_arguments_drops_the_prefetch_and_loads_as_asked(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    taskpoint.Checkpoint(store).save_sync(_tree(tmp_path / "run"))
    restores = tmp_path / "restores"
    ckpt = taskpoint.Checkpoint(store, workdir=restores)
    ckpt.prefetch()
    target = tmp_path / "into"
    restored = ckpt.load_sync(into=target)
    assert restored == target
    assert (target / "sub" / "state.json").read_text() == '{"step": 7}'
    assert list(restores.iterdir()) == [], "the dropped prefetch's folder was left behind"


def test_a_second_prefetch_with_other_arguments_replaces_the_first(tmp_path: Path) -> None:
    store = tmp_path / "store"
    taskpoint.Checkpoint(store).save_sync(_tree(tmp_path / "run"))
    restores = tmp_path / "restores"
    ckpt = taskpoint.Checkpoint(store, workdir=restores)
    ckpt.prefetch()
    ckpt.prefetch()  # the same: nothing more
    target = tmp_path / "into"
    ckpt.prefetch(into=target)
    began = time.monotonic()
    assert ckpt.load_sync(into=target) == target
    assert time.monotonic() - began < 30
    assert (target / "weights.bin").read_bytes() == bytes(range(256)) * 512
    assert list(restores.iterdir()) == [], "the replaced prefetch's folder was left behind"


def test_arguments_are_checked_at_the_call(tmp_path: Path) -> None:
    ckpt = taskpoint.Checkpoint(tmp_path / "store")
    with pytest.raises(ValueError, match="part must be a rank"):
        ckpt.prefetch(part=-1)
    with pytest.raises(ValueError, match="paths"):
        ckpt.prefetch(paths="model.pt")


def test_only_the_load_records_the_resume(tmp_path: Path) -> None:
    """A prefetch never loaded leaves no resume in the run's history; the load records one,
    with the time it waited for the restore, not the restore's own."""
    store = tmp_path / "store"
    state = bytes(range(256)) * (2**17)  # 32 MiB: its restore takes well over 10 ms
    taskpoint.Checkpoint(store, attempt=0).save_sync(state)
    unused = taskpoint.Checkpoint(store, attempt=1)
    unused.prefetch()
    _prefetch_done()
    used = taskpoint.Checkpoint(store, attempt=2)
    used.prefetch()
    _prefetch_done()
    path = used.load_sync()
    assert path is not None and path.read_bytes() == state
    records = {r.attempt: r for r in taskpoint.Checkpoint(store).attempts()}
    assert 1 not in records or records[1].resumed_from is None
    assert records[2].resumed_from is not None
    assert records[2].restore_s is not None and records[2].restore_s < 0.01


RETRY = textwrap.dedent(
    """
    import sys, time
    import taskpoint

    began = time.monotonic()
    ckpt = taskpoint.Checkpoint(sys.argv[1])
    ckpt.prefetch()
    returned = time.monotonic() - began
    path = ckpt.load_sync()
    print(path.read_text() if path else "nothing", returned, flush=True)
    """
)


@pytest.mark.slow
def test_a_prefetch_returns_at_once_and_still_waits_for_the_dead_attempts_upload(
    tmp_path: Path,
) -> None:
    """A retry started while the killed attempt's upload process still commits: its
    prefetch returns at once, and its load gets the save that upload commits."""
    from test_inflight import _killed_while_uploading

    with _killed_while_uploading(tmp_path, upload_s=4.0) as (url, _):
        done = subprocess.run(
            [sys.executable, "-c", RETRY, url], capture_output=True, text=True, timeout=600,
            env=slow_env(tmp_path, TASKPOINT_GRACE_PERIOD="300"),
        )
    assert done.returncode == 0, done.stderr
    content, _, returned = done.stdout.strip().rpartition(" ")
    assert content == "step 8", done.stderr
    assert float(returned) < 1.0, f"prefetch() blocked {returned} s"


def test_the_prefetch_thread_does_not_hold_the_interpreter_at_exit(tmp_path: Path) -> None:
    """A script that exits while its prefetch still waits (here, for an upload in flight
    that this test holds open for the whole grace period) ends at once."""
    from taskpoint.checkpoint import _inflight

    store = tmp_path / "store"
    taskpoint.Checkpoint(store).save_sync(b"x" * 1000)
    script = textwrap.dedent(
        """
        import sys, time, taskpoint
        taskpoint.Checkpoint(sys.argv[1]).prefetch()
        time.sleep(1)
        print("exiting", flush=True)
        """
    )
    env = {**os.environ, "TASKPOINT_GRACE_PERIOD": "60"}
    with _inflight.hold(str(store)):
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", script, str(store)], env=env, capture_output=True,
            text=True, timeout=120,
        )
        took = time.monotonic() - began
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr
    assert took < 30, f"the script took {took:.0f} s to exit"

"""What a job's first store calls cost: the attempt's claim, the store's client.

A restarted job pays for these on every restart, before it restores (issue #33): the claim
lists the attempt records once, a background save claims while its snapshot is copied,
and ``Checkpoint.at`` opens an object store's client while the job sets up.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import taskpoint
from taskpoint.format import history
from taskpoint.store.store import Store


def _counting_lists(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    listed: list[str] = []
    real = store.list

    def list_(name: str = "", *args: Any, **kwargs: Any) -> list[str]:
        listed.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(store, "list", list_)
    return listed


def test_a_claim_lists_the_attempt_records_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claiming the next number and noting the earlier attempts that died need one
    listing of ``attempts/``, not one each."""
    url = str(tmp_path / "run")
    store = Store(url)
    assert history.claim_attempt(store, 0) == 0  # a life killed without an end record
    assert history.claim_attempt(store, 1) == 1
    history.record_end(store, 1, "failed", "boom")
    store.write_atomic("attempts/000000", b'{"format": 1, "pid": 999999999, "host": "gone"}')
    attempt = history.Attempt(Store(url))
    listed = _counting_lists(attempt.store, monkeypatch)

    assert attempt.claim() == 2

    assert listed.count(history.ATTEMPTS) == 1
    died = {r.attempt: r for r in history.read_attempts(store)}[0]
    assert died.outcome == "crashed" and died.noted_by == 2  # still noted


def test_an_early_claim_and_a_save_claim_one_number(tmp_path: Path) -> None:
    """``claim_soon`` on a thread and a save's own claim at the same moment claim one
    number between them, and the save uses it."""
    for round_ in range(5):
        url = str(tmp_path / f"run{round_}")
        attempt = history.Attempt(Store(url))
        go = threading.Barrier(2)
        numbers: list[int] = []

        def save_claim(
            attempt: history.Attempt = attempt, go: threading.Barrier = go,
            numbers: list[int] = numbers,
        ) -> None:
            go.wait()
            numbers.append(attempt.claim())

        other = threading.Thread(target=save_claim)
        other.start()
        go.wait()
        attempt.claim_soon()
        other.join()
        assert numbers == [0]
        deadline = time.monotonic() + 30
        while attempt._lock().locked() and time.monotonic() < deadline:  # the early claim ends
            time.sleep(0.01)
        assert history.attempt_numbers(Store(url)) == [0]


def test_a_background_save_claims_while_its_snapshot_is_taken(tmp_path: Path) -> None:
    """The first background save of a checkpoint that has no number yet starts claiming
    it on a thread of its own as the call begins, so the claim's store calls overlap the
    snapshot's copy instead of following it on the upload thread; the save commits as
    that attempt."""
    folder = tmp_path / "state"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 32 * 2**20)  # a copy that takes a while
    ckpt = taskpoint.Checkpoint(str(tmp_path / "run"), background_upload="thread")
    claimed_by: list[str] = []
    real_claim = ckpt._attempt.claim

    def claim() -> int:
        claimed_by.append(threading.current_thread().name)
        return real_claim()

    ckpt._attempt.claim = claim  # type: ignore[method-assign]
    ckpt.save_sync(folder, background=True)
    ckpt.wait()
    assert claimed_by[0] == "taskpoint-claim", claimed_by
    assert [m.attempt for m in ckpt.committed()] == [0] and ckpt.attempt == 0
    assert history.attempt_numbers(Store(str(tmp_path / "run"))) == [0]
    ckpt.close()


def test_at_opens_an_object_store_ahead_of_its_first_call(s3_server: Any) -> None:
    """``Checkpoint.at`` loads the S3 client library and builds its client on a thread:
    the job's first load or save finds them ready."""
    ckpt = taskpoint.Checkpoint.at(s3_server.url("taskpoint-tests", f"warm-{uuid.uuid4().hex}"))
    location = ckpt._store._at
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        fs = location._fs
        if fs is not None and getattr(fs, "_s3", None) is not None:
            break
        time.sleep(0.05)
    else:
        pytest.fail("Checkpoint.at did not open the store's client ahead of its first call")
    assert ckpt.load_sync() is None  # and the warmed client works
    ckpt.close()


def test_a_local_store_needs_no_warming(tmp_path: Path) -> None:
    assert Store(str(tmp_path / "run")).warm() is None


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run", "az://box/run", "runs/x"])
def test_telling_a_store_from_memory_opens_nothing(url: str) -> None:
    """A background save asks whether its store is ``memory://`` (which cannot cross to the
    upload process) before it takes its snapshot: the answer comes from the URL, and the
    store's client library is not imported on the caller's thread for it."""
    store = Store(url)
    assert store.is_memory is False
    assert store._at._fs is None
    assert Store("memory://run").is_memory is True


def test_the_upload_process_opens_a_destinations_store_ahead_of_its_saves(
    s3_server: Any,
) -> None:
    """What a loading job has the upload process do before its first background save:
    open the store that save goes to, client built, so that the save's own store (made
    per request, on another thread) finds the filesystem ready."""
    from s3fs import S3FileSystem
    from taskpoint.checkpoint import _upload_child

    ckpt = taskpoint.Checkpoint.at(s3_server.url("taskpoint-tests", f"open-{uuid.uuid4().hex}"))
    destination = ckpt._saves._destination
    S3FileSystem.clear_instance_cache()  # as in a fresh upload process

    assert _upload_child.handle(destination) is None

    opened = Store(destination.url, destination.storage_options, destination.retry).fs
    assert getattr(opened, "_s3", None) is not None
    ckpt.close()


def test_a_load_has_the_upload_process_open_the_store_once(
    s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_sync`` starts the upload process and asks it, once per checkpoint, to open
    the checkpoint's store; the first background save then commits through it."""
    from taskpoint.checkpoint import _uploader

    asked: list[str] = []
    real = _uploader.Worker.open_store

    def open_store(self: _uploader.Worker, destination: _uploader.Destination) -> None:
        asked.append(destination.url)
        real(self, destination)

    monkeypatch.setattr(_uploader.Worker, "open_store", open_store)
    url = s3_server.url("taskpoint-tests", f"open-{uuid.uuid4().hex}")
    ckpt = taskpoint.Checkpoint.at(url)
    assert ckpt.load_sync() is None
    assert ckpt.load_sync() is None
    assert asked == [ckpt._saves._destination.url]
    ckpt.save_sync(b"step 1", background=True)
    ckpt.wait()
    assert ckpt.load_sync() is not None and ckpt.load_sync().read_bytes() == b"step 1"
    assert len(asked) == 1
    ckpt.close()

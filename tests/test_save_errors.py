"""Whatever goes wrong in a save surfaces as a :class:`taskpoint.CheckpointError`.

A save can fail because of the store (``CheckpointStoreError``, retried when transient) or
because of what it was given: a file that cannot be read. The second must never be retried
as a store fault nor reach the caller as a raw ``OSError``, and neither may lose the
checkpoint committed before it. ``/proc/self/mem`` is a real file whose every read fails
with ``EIO`` on Linux: a source that is unreadable even for root.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import pytest
import taskpoint
from taskpoint import Checkpoint, CheckpointSaveError, CheckpointStoreError

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux's /proc/self/mem"
)

UNREADABLE = "/proc/self/mem"


def _snapshots() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("*taskpoint-snapshot-*")}


def test_an_unreadable_file_fails_the_save_as_its_own_error_not_the_stores(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpoint(store_url)
    ckpt.save_sync(b"committed before")
    with (
        caplog.at_level(logging.WARNING, logger="taskpoint"),
        pytest.raises(CheckpointSaveError) as raised,
    ):
        ckpt.save_sync(UNREADABLE)
    assert not isinstance(raised.value, CheckpointStoreError)
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.url == ckpt.url
    assert "nothing was committed" in str(raised.value)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()], (
        "a source that cannot be read was retried as if the store had failed"
    )
    restored = Checkpoint(store_url).load_sync()
    assert restored is not None and restored.read_bytes() == b"committed before"


@pytest.mark.parametrize("snapshot", ["copy", "link"])
def test_a_background_save_of_an_unreadable_file_fails_at_once_and_leaves_nothing(
    tmp_path: Path, snapshot: str
) -> None:
    ckpt = Checkpoint(f"file://{tmp_path}/store")
    ckpt.save_sync(b"committed before")
    before = _snapshots()
    with pytest.raises(CheckpointSaveError) as raised:
        ckpt.save_sync(UNREADABLE, background=True, snapshot=snapshot)  # type: ignore[arg-type]
    assert raised.value.url is None  # it failed before reaching the store
    assert isinstance(raised.value.__cause__, OSError)
    assert _snapshots() == before, "the failed snapshot's folder was left behind"
    ckpt.wait()  # nothing was queued, so nothing fails later either
    assert ckpt.load_sync().read_bytes() == b"committed before"  # type: ignore[union-attr]


async def test_the_async_save_raises_the_same(tmp_path: Path) -> None:
    ckpt = Checkpoint(f"file://{tmp_path}/store")
    with pytest.raises(CheckpointSaveError):
        await ckpt.save(UNREADABLE)
    with pytest.raises(CheckpointSaveError):
        await ckpt.save(UNREADABLE, background=True)
    assert await ckpt.load() is None


def test_the_error_is_exported_under_checkpoint_error() -> None:
    assert issubclass(taskpoint.CheckpointSaveError, taskpoint.CheckpointError)
    assert "CheckpointSaveError" in taskpoint.__all__

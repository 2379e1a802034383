"""A multi-writer mirror uploads in the background while training goes on: its manifest
names the step and the preemption notice of the moment it was saved, not of the moment
its upload ended."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import taskpoint
from taskpoint import preemption, progress
from taskpoint.checkpoint.mirror import FolderMirror


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    preemption.reset()
    progress.reset()
    yield
    preemption.reset()
    progress.reset()


def test_a_background_part_records_the_step_it_was_saved_at(tmp_path: Path) -> None:
    gate = threading.Event()
    url = f"file://{tmp_path / 'store'}"
    ckpt = taskpoint.Checkpoint(url, progress=lambda moved: gate.wait(60))
    coordinator = taskpoint.StoreCoordinator(
        f"file://{tmp_path / 'coord'}", rank=0, world_size=1, session="s"
    )
    part = tmp_path / "stage" / "part"
    part.mkdir(parents=True)
    (part / "last.ckpt").write_bytes(b"weights at step 6")
    mirror = FolderMirror(ckpt)

    progress.report_step(6)
    mirror.save_part(part, coordinator=coordinator, step=6)
    progress.report_step(7)  # training went on while the part uploads
    preemption.relay(30.0)  # and a notice came
    gate.set()
    mirror.wait()
    newest = ckpt.committed()[0]
    assert (newest.step, newest.preemption) == (6, False)

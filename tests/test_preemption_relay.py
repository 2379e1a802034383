"""``preemption.relay``: a rank that never received the signal holds the notice once the
ranks agreed to stop, so its saves count as preemption saves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import taskpoint
from taskpoint import preemption


@pytest.fixture(autouse=True)
def _no_notice() -> Iterator[None]:
    preemption.reset()
    yield
    preemption.reset()


def test_a_relayed_notice_counts_like_a_signal(tmp_path: Path) -> None:
    assert not preemption.requested()
    notice = preemption.relay(12.0)
    assert preemption.requested() and preemption.notice() is notice
    assert notice.signal == "SIGTERM" and 11.0 < notice.remaining() <= 12.0
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    ckpt.save_sync(b"state at the agreed step")
    assert ckpt.committed()[0].preemption


def test_a_notice_of_its_own_is_kept() -> None:
    own = preemption.relay(30.0)
    time.sleep(0.01)
    assert preemption.relay(1.0) is own


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_remaining_time_that_is_not_seconds_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="remaining"):
        preemption.relay(bad)

"""Saving by training time: ``save_sync(bundle, every_s=...)`` on a fake clock (no sleeping)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import taskpoint
from sklearn.linear_model import SGDClassifier
from taskpoint.format.history import read_attempts
from taskpoint.store.store import Store
from taskpoint_sklearn import PartialFitBundle, TaskpointSklearnCheckpoint


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _train(
    tmp_path: Path, chunk_s: list[float], clock: FakeClock | None = None, **kw: object
) -> tuple[list[int], TaskpointSklearnCheckpoint]:
    """Partial-fit one chunk per entry of ``chunk_s`` (its seconds on the fake clock),
    calling ``save_sync`` after each; the chunks whose call saved."""
    clock = clock or FakeClock()
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(tmp_path.as_uri()))
    ckpt._saves.schedule.clock = clock  # the test's clock
    bundle: PartialFitBundle = ckpt.resume_sync(
        SGDClassifier(random_state=0), rng=np.random.default_rng(0)
    )
    saved = []
    for took in chunk_s:
        x = bundle.rng.standard_normal((16, 4))
        bundle.partial_fit(x, (x[:, 0] > 0).astype(int), classes=[0, 1])
        bundle.progress += 1
        clock.now += took
        if ckpt.save_sync(bundle, **kw):  # type: ignore[arg-type]
            saved.append(bundle.progress)
    return saved, ckpt


def test_every_s_saves_once_its_seconds_of_training_passed(tmp_path: Path) -> None:
    # 4 s chunks, every 10 s: due at 12 s (chunk 3), 24 s (6), 36 s (9).
    saved, ckpt = _train(tmp_path, [4.0] * 10, every_s=10)
    assert saved == [3, 6, 9]
    assert ckpt.save_interval is not None and ckpt.save_interval.interval_s == 10
    restored = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(tmp_path.as_uri())).load_sync()
    assert restored is not None and restored.progress == 9


def test_every_and_every_s_save_when_either_says_so(tmp_path: Path) -> None:
    # every=5 chunks; every_s=6 s. 1 s chunks: chunk 5 by count (6 s have not passed
    # since the start... 5 s), then the time restarts: chunk 10 by count; then 4 s
    # chunks: chunk 12 by time (8 s after 10), 14 by time, 15 by count.
    saved, _ = _train(tmp_path, [1.0] * 10 + [4.0] * 5, every=5, every_s=6)
    assert saved == [5, 10, 12, 14, 15]


def test_every_s_auto_uses_the_prior_on_a_new_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "600")
    saved, ckpt = _train(tmp_path, [1.0] * 20, every_s="auto")
    assert saved[0] == 1, "the first save is due at once: it measures the cost"
    assert len(saved) < 20, "not at every chunk"
    choice = ckpt.save_interval
    assert choice is not None and choice.mtbf_s == 600.0 and choice.failures == 0
    (record,) = read_attempts(Store(tmp_path.as_uri()))
    assert record.interval is not None and record.interval["prior_s"] == 600.0


def test_a_bad_every_s_says_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='every_s must be a positive number of seconds or "auto"'):
        _train(tmp_path, [1.0], every_s="often")

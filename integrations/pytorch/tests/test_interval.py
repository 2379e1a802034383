"""Saving by training time: ``save_sync(..., every_s=...)`` on a fake clock (no sleeping),
and rank agreement under a real torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import taskpoint
import torch
from taskpoint.format.history import read_attempts
from taskpoint.store.store import Store
from taskpoint_pytorch import TaskpointState
from torch import nn

WORKER = Path(__file__).parent / "tp_torch_interval_worker.py"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _state(clock: FakeClock, **kwargs: object) -> TaskpointState:
    model = nn.Linear(3, 1)
    state = TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)  # type: ignore[arg-type]
    state._preemption.schedule.clock = clock  # the test's clock
    return state


def _begin(state: TaskpointState, checkpoint: taskpoint.Checkpoint) -> taskpoint.Checkpoint:
    assert state.restore_sync(checkpoint) is None  # training starts: the time counts from here
    return checkpoint


def _run(
    state: TaskpointState, checkpoint: object, clock: FakeClock, step_s: list[float], **kw: object
) -> list[int]:
    saved = []
    for step, took in enumerate(step_s, start=1):
        clock.now += took
        if state.save_sync(checkpoint, step=step, **kw):  # type: ignore[arg-type]
            saved.append(step)
    return saved


def test_every_s_saves_once_its_seconds_of_training_passed(tmp_path: Path) -> None:
    clock = FakeClock()
    state = _state(clock)
    checkpoint = _begin(state, taskpoint.Checkpoint(tmp_path.as_uri()))
    # 3 s steps, then 1 s steps: due at 12 s (step 4), then 10 s later (22 s: step 12).
    saved = _run(state, checkpoint, clock, [3.0] * 5 + [1.0] * 12, every_s=10)
    assert saved == [4, 12]
    assert state.save_interval is not None and state.save_interval.rule == "fixed"
    assert [m.step for m in checkpoint.committed()][:1] == [12]


def test_every_and_every_s_save_when_either_says_so(tmp_path: Path) -> None:
    clock = FakeClock()
    state = _state(clock)
    checkpoint = _begin(state, taskpoint.Checkpoint(tmp_path.as_uri()))
    # every=4 steps, every_s=10 s, 2 s steps: steps 4, 8 by count; the time restarts at each
    # save, so 10 s (5 steps) never pass between them; then 5 s steps: step 10 by time
    # (10 s after step 8), step 12 by count.
    saved = _run(state, checkpoint, clock, [2.0] * 8 + [5.0] * 4, every=4, every_s=10)
    assert saved == [4, 8, 10, 12]


def test_every_s_auto_saves_first_then_at_young_daly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKPOINT_MTBF_PRIOR_S", "100")
    clock = FakeClock()
    state = _state(clock)
    checkpoint = taskpoint.Checkpoint(tmp_path.as_uri())
    assert _run(state, checkpoint, clock, [1.0], every_s="auto") == [1], "first: measure it"
    choice = state.save_interval
    assert choice is not None and choice.mtbf_s == 100.0 and choice.prior_s == 100.0
    # A real save on this machine costs milliseconds: the 2% bound (cost / 0.02) or
    # Young/Daly, seconds at most (under 60 s for any save under 1.2 s); 1 s steps save
    # again within a few steps, never at each.
    saved = _run(state, checkpoint, clock, [1.0] * 60, every_s="auto")
    assert 1 <= len(saved) < 60
    (record,) = read_attempts(Store(tmp_path.as_uri()))
    assert record.interval is not None and record.interval["every"] == "auto"


def test_a_bad_every_s_says_what_is_accepted(tmp_path: Path) -> None:
    state = _state(FakeClock())
    checkpoint = taskpoint.Checkpoint(tmp_path.as_uri())
    for bad in (0, -1.0, "hourly", True, float("inf")):
        with pytest.raises(ValueError, match='every_s must be a positive number of seconds or "auto"'):
            state.save_sync(checkpoint, step=1, every_s=bad)  # type: ignore[arg-type]


def test_a_background_save_restarts_the_time_too(tmp_path: Path) -> None:
    clock = FakeClock()
    state = _state(clock, blocking=False)
    checkpoint = _begin(state, taskpoint.Checkpoint(tmp_path.as_uri()))
    saved = _run(state, checkpoint, clock, [4.0] * 6, every_s=7)
    state.wait()
    assert saved == [2, 4, 6]


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)
def test_torchrun_ranks_save_at_the_step_rank_zeros_clock_says(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    """Two ranks whose clocks disagree (rank 1's says a save is due at every step and rank
    0's every fifth, then the other way round) save at the same steps: rank 0's."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            "--nproc_per_node=2", "--monitor-interval=0.2", str(WORKER),
            (tmp_path / "store").as_uri(), str(tmp_path),
        ],
        env={**child_env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    ranks = [json.loads((tmp_path / f"saves-rank{r}.json").read_text()) for r in (0, 1)]
    # Rank 1 fast: its own clock says due at every step; rank 0's at steps 5 and 10.
    assert ranks[1]["rank1-fast"]["locally_due"][:3] == [1, 2, 3]
    assert ranks[0]["rank1-fast"]["saved"] == ranks[1]["rank1-fast"]["saved"] == [5, 10]
    # Rank 0 fast: rank 0's clock says due at every step, so both save at every step,
    # though rank 1's own clock (1 s since each save) never says so.
    assert ranks[1]["rank0-fast"]["locally_due"] == []
    assert ranks[0]["rank0-fast"]["saved"] == ranks[1]["rank0-fast"]["saved"] == list(range(1, 13))

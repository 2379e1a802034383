"""A run's goodput and badput by cause, computed from the records real runs leave behind."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import taskpoint
from taskpoint.format.history import AttemptRecord, read_attempts
from taskpoint.inspect.goodput import goodput
from taskpoint.store.store import Store

STEP_S = 0.05


def _records(url: str) -> tuple[list[AttemptRecord], list[taskpoint.Manifest]]:
    return read_attempts(Store(url)), taskpoint.Checkpoint(url).committed()


def test_three_attempts_of_a_task(tmp_path: Path) -> None:
    """Two failures, a save every 3 steps: steps lost, restore and blocked time as recorded,
    and the parts of the wall time adding up."""
    env = taskpoint.TaskEnvironment(name="gp", root=str(tmp_path / "store"), run_id="r", keep=50)
    fail_at = {0: 7, 1: 14}  # attempt -> the step it raises after

    @env.task(retries=2, backoff=0)
    def train() -> int:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        ckpt = context.checkpoint
        prev = ckpt.load_sync()
        step = int(prev.read_bytes()) if prev else 0
        while step < 20:
            time.sleep(STEP_S)
            step += 1
            taskpoint.report_step(step)
            if step % 3 == 0:
                ckpt.save_sync(str(step).encode())
            if step == fail_at.get(context.attempt):
                raise RuntimeError(f"failure at step {step}")
        return step

    started = time.time()
    assert train() == 20
    outside = time.time() - started
    history, manifests = _records(str(tmp_path / "store" / "gp.train" / "r"))

    cost = goodput(history, manifests)

    assert [c.attempt for c in cost.attempts] == [0, 1, 2]
    assert [c.outcome for c in cost.attempts] == ["failed", "failed", "succeeded"]
    assert [c.resumed_step for c in cost.attempts] == [0, 6, 12]
    assert [c.steps_lost for c in cost.attempts] == [1, 2, None]  # 7 -> 6, 14 -> 12
    assert cost.steps_lost == 3 and cost.final_step == 20
    assert cost.badput_s["restore"] == pytest.approx(
        sum(r.restore_s or 0 for r in history)) and cost.badput_s["restore"] > 0
    blocked = sum(m.stats["blocked_s"] for m in manifests if m.stats)
    # the end records' totals: each save's time to its commit, a little past its manifest's
    assert cost.badput_s["blocked"] == pytest.approx(sum(r.blocked_s or 0 for r in history))
    assert cost.badput_s["blocked"] >= blocked > 0
    assert [c.saves for c in cost.attempts] == [2, 2, 2]  # 3, 6; 9, 12; 15, 18
    assert cost.wall_s is not None and 20 * STEP_S < cost.wall_s <= outside
    assert all(c.restart_s is not None and c.restart_s >= 0 for c in cost.attempts[1:])
    # the step time is estimated: at least the sleep, and not wildly more on a busy machine
    assert cost.step_s is not None and STEP_S * 0.9 <= cost.step_s < STEP_S * 4
    assert any("estimated" in line for line in cost.missing)
    assert cost.badput_s["recomputed"] == pytest.approx(3 * cost.step_s)
    parts = [cost.productive_s, *cost.badput_s.values()]
    assert all(p is not None for p in parts)
    assert math.fsum(p for p in parts if p is not None) == pytest.approx(cost.wall_s)
    assert cost.goodput is not None and 0 < cost.goodput <= 1

    known = goodput(history, manifests, step_s=STEP_S)
    assert known.step_s == STEP_S and known.productive_s == pytest.approx(20 * STEP_S)
    assert not any("estimated" in line for line in known.missing)


def test_a_life_killed_without_an_end_record(tmp_path: Path) -> None:
    """Two process lives under the environment contract, the first SIGKILLed: its end and its
    step come from its last save, and the gap to the next life is the restart."""
    script = tmp_path / "life.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        import taskpoint

        ckpt = taskpoint.ctx().checkpoint
        prev = ckpt.load_sync()
        step = int(prev.read_bytes()) if prev else 0
        while step < 10:
            time.sleep(0.05)
            step += 1
            taskpoint.report_step(step)
            if step % 2 == 0:
                ckpt.save_sync(str(step).encode())
            if step == 4 and os.environ.get("DIE") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
        """))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env = {**clean, "TASKPOINT_ROOT": str(tmp_path / "store"), "TASKPOINT_ACTION": "life",
           "TASKPOINT_RUN_ID": "k8s"}
    first = subprocess.run([sys.executable, str(script)], env={**env, "DIE": "1"},
                           capture_output=True, text=True)
    assert first.returncode == -9, first.stderr
    second = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True)
    assert second.returncode == 0, second.stderr
    history, manifests = _records(str(tmp_path / "store" / "life" / "k8s"))

    cost = goodput(history, manifests, step_s=0.05)

    died, last = cost.attempts[0], cost.attempts[-1]
    assert died.attempt == 0 and died.step == 4 and died.steps_lost == 0
    assert last.resumed_step == 4 and cost.final_step == 10
    assert died.ended is not None and last.began is not None and died.ended <= last.began
    assert last.restart_s == pytest.approx(last.began - died.ended)
    if died.outcome is None:  # nothing wrote the killed life's end
        assert any("attempt 0 has no end record" in line for line in cost.missing)
    # retention (keep=1) deleted its saves: its step is where the next life resumed
    assert any("attempt 0's step is the one the next attempt resumed" in line
               for line in cost.missing)
    assert cost.goodput is not None and 0 < cost.goodput <= 1


def test_partial_and_garbage_records_never_raise() -> None:
    assert goodput([]).goodput is None and goodput([]).attempts == ()
    bare = goodput([AttemptRecord(attempt=0), AttemptRecord(attempt=3)])
    assert bare.wall_s is None and bare.goodput is None and bare.badput_s["other"] is None
    assert bare.attempts[0].steps_lost is None
    assert any("no span of time" in line for line in bare.missing)
    one = goodput([AttemptRecord(attempt=0, started=100.0, ended=110.0, outcome="succeeded",
                                 step=50)], step_s=0.1)
    assert one.wall_s == 10.0 and one.productive_s == pytest.approx(5.0)
    assert one.goodput == pytest.approx(0.5) and one.badput_s["other"] == pytest.approx(5.0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_step_time_that_is_not_positive_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="step_s must be a positive number"):
        goodput([], step_s=bad)


def test_blocked_time_survives_retention(tmp_path: Path) -> None:
    """keep=1 deletes every save but the newest, yet each attempt's end record keeps how
    many saves it committed and how long training waited in them: the run's blocked time
    is every save's, not only the last one's."""
    env = taskpoint.TaskEnvironment(name="gp", root=str(tmp_path / "store"), run_id="r", keep=1)
    seen: list[taskpoint.SaveStats] = []

    @env.task(retries=2, backoff=0)
    def train() -> int:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        ckpt = context.checkpoint
        ckpt.on_commit(seen.append)
        prev = ckpt.load_sync()
        step = int(prev.read_bytes()) if prev else 0
        while step < 12:
            step += 1
            taskpoint.report_step(step)
            if step % 2 == 0:
                ckpt.save_sync(str(step).encode())
            if step == {0: 5, 1: 9}.get(context.attempt or 0):
                raise RuntimeError(f"failure at step {step}")
        return step

    assert train() == 12
    history, manifests = _records(str(tmp_path / "store" / "gp.train" / "r"))
    assert len(manifests) == 1  # retention kept the newest only

    cost = goodput(history, manifests)

    assert [r.saves for r in history] == [2, 2, 2]  # 2, 4; 6, 8; 10, 12
    assert [c.saves for c in cost.attempts] == [2, 2, 2]
    for record in history:
        mine = [s.blocked_s for s in seen if s.attempt == record.attempt]
        assert record.blocked_s is not None and record.blocked_s > 0
        assert record.blocked_s == pytest.approx(sum(mine), abs=1e-5)
    assert cost.badput_s["blocked"] == pytest.approx(sum(s.blocked_s for s in seen), abs=1e-5)
    assert not any("retention deleted" in line or "no blocked time" in line
                   for line in cost.missing)


def test_end_records_without_totals_still_read(tmp_path: Path) -> None:
    """An end record of an older version has no ``blocked_s``/``saves``: they read as
    unknown, and the blocked time comes from the attempt's kept manifests as before."""
    store = Store(str(tmp_path / "run"))
    ckpt = taskpoint.Checkpoint(str(tmp_path / "run"), attempt=0, keep=5)
    ckpt.mark_started()
    ckpt.save_sync(b"one")
    store.write_atomic("attempts/000000.end.json",
                       b'{"format": 1, "ended": 1e10, "outcome": "succeeded", "step": 3}')
    (record,) = read_attempts(store)
    assert record.blocked_s is None and record.saves is None
    manifests = ckpt.committed()
    assert manifests[0].stats is not None
    (cost,) = goodput([record], manifests).attempts
    assert cost.saves == 1 and cost.blocked_s == pytest.approx(manifests[0].stats["blocked_s"])
    ckpt.close()

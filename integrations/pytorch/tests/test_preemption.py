"""SIGTERM becomes a save at the next step boundary, with the README quickstart's lines only.

Real tasks in real processes (tp_torch_preempt.py), real signals, a file:// store; the
attempt records say where each attempt stopped and resumed, and the final state must
equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

CHILD = Path(__file__).parent / "tp_torch_preempt.py"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _train(
    tmp_path: Path, child_env: dict[str, str], config: dict[str, Any], *,
    isolation: str = "inline", **env: str,
) -> tuple[dict[str, Any], dict[str, Any], str]:
    out = tmp_path / "final.pt"
    environ = {k: v for k, v in child_env.items() if not k.startswith("TASKPOINT_")}
    environ.update(TASKPOINT_ROOT=f"file://{tmp_path / 'store'}", ISOLATION=isolation, **env)
    done = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config), str(out)],
        env=environ, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    return json.loads(line), torch.load(out, weights_only=True), done.stderr


@pytest.fixture(scope="module")
def epochs_reference(lib: ModuleType) -> dict[str, Any]:
    return lib.run(lib.build())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def steps_reference(lib: ModuleType) -> dict[str, Any]:
    return lib.run_steps(lib.build(), lib.data_generator())  # type: ignore[no-any-return]


@pytest.mark.slow
def test_sigterm_at_a_random_step_saves_at_the_epoch_end_and_resumes_there_exactly(
    lib: ModuleType, tmp_path: Path, child_env: dict[str, str],
    epochs_reference: dict[str, Any],
) -> None:
    """The quickstart loop (one blocking save per epoch) with nothing added: the signal
    is saved at the end of the epoch it arrived in, not lost with it."""
    at = random.Random().randint(2, lib.EPOCHS * lib.STEPS_PER_EPOCH - 1)
    seen, result, log = _train(
        tmp_path, child_env, {"loop": "epochs", "fail": {"0": ["term", at]}}
    )
    epoch_end = math.ceil(at / lib.STEPS_PER_EPOCH) * lib.STEPS_PER_EPOCH
    first, second = seen["attempts"]
    assert (first["outcome"], first["step"], first["preemption_save"]) == (
        "preempted", epoch_end, "committed"), (at, seen)
    assert first["steps_lost"] == 0 and second["resumed_step"] == epoch_end, (at, seen)
    assert second["outcome"] == "succeeded"
    marked = [s["step"] for s in seen["saves"] if s["preemption"]]
    assert marked == [epoch_end], (at, seen)
    assert f"SIGTERM at step {epoch_end}: the preemption save committed" in log
    assert lib.bitwise_differences(result, epochs_reference) == [], at


@pytest.mark.slow
def test_every_step_a_boundary_sigterm_stops_at_that_step_and_sigkill_loses_to_the_last_save(
    lib: ModuleType, tmp_path: Path, child_env: dict[str, str],
    steps_reference: dict[str, Any],
) -> None:
    """``save_sync(..., every=3)`` at every step, background saves, process isolation:
    SIGTERM at a random step is saved at that step; a SIGKILL later in the next attempt
    resumes from the last save committed before it."""
    at = random.Random().randint(2, 7)
    kill = at + 4  # attempt 1 resumes at ``at``; saves at the multiples of 3 after it
    seen, result, _ = _train(
        tmp_path, child_env,
        {"loop": "steps", "every": 3, "background": True,
         "fail": {"0": ["term", at], "1": ["kill", kill]}},
        isolation="process",
    )
    first, second, third = seen["attempts"]
    assert (first["outcome"], first["step"], first["preemption_save"]) == (
        "preempted", at, "committed"), (at, seen)
    assert first["steps_lost"] == 0 and second["resumed_step"] == at, (at, seen)
    # The newest save committed when attempt 2 loaded: a background upload may still
    # commit after the kill (the upload runs in a process of its own), or not.
    before = [s for s in seen["saves"] if s["created"] <= third["resumed_at"]]
    assert second["outcome"] == "crashed" and third["resumed_step"] == before[-1]["step"]
    assert third["resumed_step"] in [at, *(s for s in range(at + 1, kill) if s % 3 == 0)]
    assert third["outcome"] == "succeeded"
    assert [s["step"] for s in seen["saves"] if s["preemption"]] == [at], (at, seen)
    assert lib.bitwise_differences(result, steps_reference) == [], at


@pytest.mark.slow
def test_an_exception_one_step_after_a_background_save_resumes_from_it_committed_first(
    lib: ModuleType, tmp_path: Path, child_env: dict[str, str],
    steps_reference: dict[str, Any],
) -> None:
    """The upload of the save at step 3 is still running when step 5 raises: the attempt
    ends only once it has committed (its record is written after the commit)."""
    seen, result, _ = _train(
        tmp_path, child_env,
        {"loop": "steps", "every": 3, "background": True, "slow_upload": 2.0,
         "fail": {"0": ["raise", 5]}},
    )
    first, second = seen["attempts"]
    assert (first["outcome"], first["step"]) == ("failed", 4), seen
    assert second["resumed_step"] == 3 and first["steps_lost"] == 1, seen
    (save3,) = [s for s in seen["saves"] if s["step"] == 3]
    assert save3["attempt"] == 0 and save3["created"] < first["ended"], seen
    assert lib.bitwise_differences(result, steps_reference) == []


@pytest.mark.slow
def test_a_grace_period_too_short_for_the_save_keeps_the_previous_checkpoint(
    lib: ModuleType, tmp_path: Path, child_env: dict[str, str],
    epochs_reference: dict[str, Any],
) -> None:
    seen, result, log = _train(
        tmp_path, child_env, {"loop": "epochs", "fail": {"0": ["term", 6]}},
        TASKPOINT_GRACE_PERIOD="0.3",
    )
    first, second = seen["attempts"]
    assert (first["outcome"], first["step"], first["preemption_save"]) == (
        "preempted", 8, "missed"), seen
    assert second["resumed_step"] == 4 and first["steps_lost"] == 4, seen
    assert not any(s["preemption"] for s in seen["saves"])
    assert "SIGTERM at step 8: no preemption save" in log
    assert lib.bitwise_differences(result, epochs_reference) == []


DDP_WORKER = Path(__file__).parent / "tp_torch_preempt_ddp.py"
needs_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _torchrun(
    tmp_path: Path, child_env: dict[str, str], *args: str, **env: str
) -> dict[int, list[dict[str, Any]]]:
    """The DDP worker under torchrun, 2 ranks, one restart allowed, outside any task; each
    rank's events."""
    environ = {k: v for k, v in child_env.items() if not k.startswith("TASKPOINT_")}
    environ.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
         "--nproc_per_node=2", "--monitor-interval=0.2", "--max-restarts=1", str(DDP_WORKER),
         f"file://{tmp_path / 'store'}", str(tmp_path), *args],
        env=environ, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return {
        rank: [json.loads(x) for x in (tmp_path / f"events-rank{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    }


def _assert_every_rank_as_uninterrupted(lib: ModuleType, tmp_path: Path, detail: object) -> None:
    expected = torch.load(tmp_path / "reference-rank0.pt", weights_only=True)
    assert expected["step"] == 10
    for rank in (0, 1):
        got = torch.load(tmp_path / f"final-rank{rank}.pt", weights_only=True)
        assert lib.bitwise_differences(got, expected) == [], (rank, detail)


@pytest.mark.slow
@needs_gloo
def test_torchrun_sigterm_on_one_rank_stops_every_rank_at_that_step_and_resumes_exactly(
    lib: ModuleType, tmp_path: Path, child_env: dict[str, str]
) -> None:
    """Outside a task, with the documented switch: rank 1 alone receives SIGTERM; both
    ranks stop after that step, rank 0 commits the preemption save (though it received no
    signal) and records the attempt's end, and the restarted group resumes there."""
    at = random.Random().randint(2, 9)
    events = _torchrun(
        tmp_path, child_env, "--term-rank", "1", "--term-step", str(at),
        TASKPOINT_SAVE_ON_PREEMPTION="1",
    )
    for rank in (0, 1):
        stopped = [e["step"] for e in events[rank] if e["event"] == "preempted"]
        resumed = [e["step"] for e in events[rank] if e["event"] == "resume"]
        assert stopped == [at] and resumed == [None, at], (rank, at, events[rank])
    assert [e["step"] for e in events[1] if e["event"] == "sigterm"] == [at]
    assert not any(e["event"] == "sigterm" for e in events[0])

    from taskpoint import Checkpoint
    from taskpoint.format.history import read_attempts, steps_lost
    from taskpoint.store.store import Store

    store = f"file://{tmp_path / 'store'}"
    first, second = read_attempts(Store(store))
    assert (first.outcome, first.step, first.preemption_save) == ("preempted", at, "committed")
    assert second.resumed_step == at and steps_lost(first, second.resumed_step) == 0
    marked = [(m.attempt, m.step) for m in Checkpoint(store).committed() if m.preemption]
    assert marked == [(0, at)], "rank 0 marked its save though the signal reached rank 1 only"
    _assert_every_rank_as_uninterrupted(lib, tmp_path, at)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize(
    ("failing", "switch"),
    [
        pytest.param(0, False, id="uploading-rank"),
        pytest.param(1, True, id="other-rank-with-the-switch"),
        pytest.param(1, False, id="other-rank"),
    ],
)
def test_torchrun_exception_one_step_after_a_background_save_resumes_from_it_on_every_rank(
    lib: ModuleType, tmp_path: Path, child_env: dict[str, str], failing: int, switch: bool
) -> None:
    """Background saves every 3 steps, each upload held 2 s in rank 0's upload thread: one
    rank raises before step 7, while the save at step 6 still uploads, and torchrun tears
    the other rank down. The save commits before rank 0 ends, and the restarted group
    (started at once) resumes at step 6 on both ranks, exactly. When rank 1 fails, rank 0
    gets torchrun's SIGTERM while its upload runs: with the switch it saves on the signal;
    without it (the default outside a task) the signal, which nothing else handles, still
    waits for the upload in flight before it ends rank 0."""
    events = _torchrun(
        tmp_path, child_env, "--background", "--every", "3", "--slow-upload", "2",
        "--raise-rank", str(failing), "--raise-step", "7",
        **({"TASKPOINT_SAVE_ON_PREEMPTION": "1"} if switch else {}),
    )
    assert [e["step"] for e in events[failing] if e["event"] == "raise"] == [7]
    for rank in (0, 1):
        resumed = [e["step"] for e in events[rank] if e["event"] == "resume"]
        assert resumed == [None, 6], (rank, events[rank])

    from taskpoint import Checkpoint
    from taskpoint.format.history import read_attempts
    from taskpoint.store.store import Store

    store = f"file://{tmp_path / 'store'}"
    first, second = read_attempts(Store(store))
    assert second.resumed_step == 6, (first, second)
    (save6,) = [m for m in Checkpoint(store).committed() if m.step == 6]
    assert save6.attempt == 0
    _assert_every_rank_as_uninterrupted(lib, tmp_path, failing)

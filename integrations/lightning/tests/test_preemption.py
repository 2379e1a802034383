"""Real preemptions: SIGTERM, exceptions and SIGKILL in training processes of their own
(``preempt_script.py``), and where the next attempt resumes, read from the run records."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from taskpoint.format.history import AttemptRecord, read_attempts, steps_lost
from taskpoint.store.store import Store

SCRIPT = Path(__file__).with_name("preempt_script.py")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
]


def run(
    tmp_path: Path, *args: str, timeout: float = 400, **env: str
) -> subprocess.CompletedProcess[str]:
    """``preempt_script.py`` in a new session (a group SIGKILL stays inside it)."""
    environ = {**os.environ, "PYTHONWARNINGS": "ignore", "TP_ROOT": root(tmp_path), **env}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        environ.pop(name, None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "final.pt"), *args], cwd=tmp_path,
        env=environ, capture_output=True, text=True, timeout=timeout, start_new_session=True,
    )


def torchrun(
    tmp_path: Path, *args: str, timeout: float = 400, **env: str
) -> subprocess.CompletedProcess[str]:
    """``preempt_script.py --devices 2`` under ``torchrun --standalone --nproc_per_node=2``
    (two CPU ranks, gloo), writing ``tmp_path/final.pt`` and ``final-rank1.pt``. A launch
    still running after ``timeout`` is stopped as a job scheduler would: SIGTERM to torchrun,
    which stops its workers (SIGKILL 30 s later), then SIGKILL; the test fails."""
    environ = {
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
        "TP_ROOT": root(tmp_path), **env,
    }
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        environ.pop(name, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(SCRIPT), str(tmp_path / "final.pt"), "--devices", "2", *args,
    ]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        pytest.fail(f"torchrun still ran after {timeout:g}s: {err[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def why(done: subprocess.CompletedProcess[str]) -> str:
    """The end of a launch's output, without DDP's warning lines: the workers' errors and
    torchrun's account of how each worker ended."""
    lines = [line for line in done.stderr.splitlines() if "reducer.cpp" not in line]
    return done.stdout[-2000:] + "\n".join(lines)[-6000:]


def ends(proc: subprocess.CompletedProcess[str]) -> dict[int, tuple[int, str]]:
    """Each rank's ``ENDED`` line: the step it stopped at and the exception that ended it."""
    return {
        int(words[3]): (int(words[1]), words[4])
        for words in map(str.split, proc.stdout.splitlines()) if words[:1] == ["ENDED"]
    }


def results(tmp_path: Path) -> list[dict[str, torch.Tensor]]:
    """Both ranks' final weights from a two-rank launch."""
    return [torch.load(tmp_path / name) for name in ("final.pt", "final-rank1.pt")]


def root(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def records(tmp_path: Path, action: str = "lt.train_task/r1") -> list[AttemptRecord]:
    return read_attempts(Store(f"{root(tmp_path)}/{action}"))


def starts(proc: subprocess.CompletedProcess[str], rank: int = 0) -> list[tuple[int, int]]:
    """Where global rank ``rank`` started training (epoch, step), each attempt in turn."""
    return [
        (int(words[1]), int(words[2]))
        for words in map(str.split, proc.stdout.splitlines())
        if words[:1] == ["STARTED"] and words[3:5] == ["rank", str(rank)]
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """An uninterrupted run's final weights (the script's single-process settings)."""
    L.seed_everything(0)
    model = lib.TinyModule()
    lib.trainer(
        [], enable_checkpointing=False, default_root_dir=tmp_path_factory.mktemp("reference")
    ).fit(model, lib.loader("resumable"))
    return lib.weights(model)


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    """An uninterrupted two-rank torchrun run's final weights, per rank (no checkpoint)."""
    where = tmp_path_factory.mktemp("torchrun-reference")
    done = torchrun(where, "--reference")
    assert done.returncode == 0, why(done)
    return results(where)


def test_sigterm_saves_at_that_step_and_the_retry_resumes_there_exactly(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    # Saves every 3 steps; SIGTERM arrives during the batch after step 7, inside epoch 1.
    done = run(tmp_path, "--task", "--sigterm-at", "7", TASKPOINT_GRACE_PERIOD="120")
    assert done.returncode == 0, done.stderr[-4000:]
    assert starts(done) == [(0, 0), (1, 8)]
    assert "SIGTERM received: stopped at step 8" in done.stderr
    first, second = records(tmp_path)
    assert (first.outcome, first.step, first.preemption_save) == ("preempted", 8, "committed")
    assert (second.outcome, second.resumed_step) == ("succeeded", 8)
    assert steps_lost(first, second.resumed_step) == 0
    lib.assert_bitwise_equal(torch.load(tmp_path / "final.pt"), reference)

    shown = subprocess.run(
        [sys.executable, "-m", "taskpoint.cli", "show", "lt.train_task/r1", "--root",
         root(tmp_path), "--json", "--no-verify"],
        capture_output=True, text=True, timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert '"steps_lost": 0' in json.dumps(json.loads(shown.stdout))


def test_a_grace_period_too_short_for_the_save_keeps_the_previous_checkpoint(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    # Uploads after the first stall 8 s; 3 s of grace leave 2 s to wait for step 6's upload,
    # still in flight at the stop (step 8) however slowly the steps run: the preemption
    # save is skipped.
    done = run(
        tmp_path, "--task", "--sigterm-at", "7", "--slow-uploads", "8",
        TASKPOINT_GRACE_PERIOD="3",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "SIGTERM received: stopped at step 8" in done.stderr and "missed" in done.stderr
    first, second = records(tmp_path)
    assert (first.outcome, first.step, first.preemption_save) == ("preempted", 8, "missed")
    assert second.resumed_step in (3, 6)  # the checkpoint before the signal
    assert starts(done)[1][1] == second.resumed_step
    lib.assert_bitwise_equal(torch.load(tmp_path / "final.pt"), reference)


def test_a_sigterm_that_is_not_a_save_waits_for_the_upload_only_within_the_grace_period(
    tmp_path: Path,
) -> None:
    # SIGTERM without a preemption save: the attempt waits for step 6's upload in flight,
    # but stalled 30 s it cannot commit within 6 s of grace: the wait ends MARGIN_S before
    # the deadline (preempt_timeout, 60 s, alone would outlast the grace period's SIGKILL).
    # Only that attempt matters: no retry (TP_RETRIES=0).
    done = run(
        tmp_path, "--task", "--sigterm-at", "7", "--slow-uploads", "30",
        TASKPOINT_GRACE_PERIOD="6", TASKPOINT_SAVE_ON_PREEMPTION="0", TP_RETRIES="0",
    )
    (signalled,) = [
        float(words[1]) for words in map(str.split, done.stdout.splitlines())
        if words[:1] == ["SIGNALLED"]
    ]
    waited = [
        float(found) for found in re.findall(r"still runs after ([0-9.]+)s", done.stderr)
    ]
    assert waited and max(waited) < 6.0, done.stderr[-4000:]  # not preempt_timeout's 60 s
    first = records(tmp_path)[0]
    assert first.outcome == "preempted" and first.ended is not None, done.stderr[-4000:]
    assert first.ended - signalled < 20.0, "the attempt ended without waiting for the upload"


def test_an_exception_one_step_after_a_save_resumes_from_that_save(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    done = run(tmp_path, "--task", "--fail-at", "4")
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = records(tmp_path)
    assert (first.outcome, first.step) == ("failed", 4)
    assert (second.outcome, second.resumed_step) == ("succeeded", 3)
    assert steps_lost(first, second.resumed_step) == 1
    lib.assert_bitwise_equal(torch.load(tmp_path / "final.pt"), reference)


def test_sigkill_two_steps_after_the_first_save_resumes_from_it(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """A machine lost two steps (2 s) after the job's first save, its upload process with
    it: that background save must have committed by then."""
    contract = {"TASKPOINT_ROOT": root(tmp_path), "TASKPOINT_ACTION": "lt", "TASKPOINT_RUN_ID": "k"}
    killed = run(
        tmp_path, "--kill-group-at", "5", "--step-sleep", "1", TASKPOINT_ATTEMPT="0", **contract
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run(tmp_path, TASKPOINT_ATTEMPT="1", **contract)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert starts(resumed) == [(0, 3)]
    # attempts numbered by the environment; each process records its life, and the killed
    # one is recorded as died by the next
    history = records(tmp_path, "lt/k")
    assert {r.attempt: r.resumed_step for r in history} == {0: None, 1: 3}
    assert [(r.outcome, r.noted_by) for r in history] == [("crashed", 1), ("succeeded", None)]
    lib.assert_bitwise_equal(torch.load(tmp_path / "final.pt"), reference)


def test_sigterm_to_one_ddp_rank_stops_both_at_one_step_saved_by_the_other(
    tmp_path: Path,
) -> None:
    """Rank 1 alone receives SIGTERM; rank 0, which writes the checkpoint, never does.
    20 samples over 2 ranks in batches of 4: 3 steps an epoch."""
    contract: dict[str, Any] = {
        "TASKPOINT_ROOT": root(tmp_path), "TASKPOINT_ACTION": "ddp", "TASKPOINT_RUN_ID": "r1",
        "TASKPOINT_SAVE_ON_PREEMPTION": "1", "TASKPOINT_GRACE_PERIOD": "120",
    }
    stopped = run(
        tmp_path, "--devices", "2", "--sigterm-at", "4", "--sigterm-rank", "1",
        TASKPOINT_ATTEMPT="0", **contract,
    )
    assert stopped.returncode != 0
    assert "SIGTERM received: stopped at step 5" in stopped.stderr, stopped.stderr[-4000:]
    assert stopped.stderr.count("Preempted: SIGTERM received: stopped at step 5") == 2  # both
    newest = taskpoint.Checkpoint(f"{root(tmp_path)}/ddp/r1").committed()[0]
    assert (newest.step, newest.preemption) == (5, True)
    assert newest.parts is not None and sorted(newest.parts) == ["0", "1"]

    resumed = run(tmp_path, "--devices", "2", TASKPOINT_ATTEMPT="1", **contract)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [starts(resumed, rank) for rank in (0, 1)] == [[(1, 5)], [(1, 5)]], resumed.stdout
    first, second = records(tmp_path, "ddp/r1")  # rank 0 records the end: no runner does
    assert (first.outcome, first.step, first.preemption_save) == ("preempted", 5, "committed")
    assert (second.attempt, second.resumed_step) == (1, 5)
    restored = taskpoint.Checkpoint(f"{root(tmp_path)}/ddp/r1").load_sync()
    assert restored is not None
    assert torch.load(restored / "last.ckpt", weights_only=False)["global_step"] == 15


def test_an_exception_on_one_ddp_rank_lets_the_upload_in_flight_commit(tmp_path: Path) -> None:
    """Rank 1 fails while both ranks' parts of step 6 upload (stalled 3 s), and its
    process ends as soon as fit raises: its on_exception must wait for its part, or the
    commit never lands. 3 steps an epoch, a save every 3."""
    contract = {"TASKPOINT_ROOT": root(tmp_path), "TASKPOINT_ACTION": "ddp", "TASKPOINT_RUN_ID": "x"}
    failed = run(
        tmp_path, "--devices", "2", "--fail-at", "7", "--fail-rank", "1", "--exit-hard",
        "--slow-uploads", "3", TASKPOINT_ATTEMPT="0", **contract,
    )
    assert failed.returncode != 0
    assert "planned failure at step 7" in failed.stderr, failed.stderr[-4000:]
    newest = taskpoint.Checkpoint(f"{root(tmp_path)}/ddp/x").committed()[0]
    assert newest.step == 6, failed.stderr[-4000:]


def test_torchrun_sigterm_to_one_rank_stops_both_at_one_step_and_resumes_there_exactly(
    tmp_path: Path, torchrun_reference: list[dict[str, torch.Tensor]]
) -> None:
    """``torchrun``, two ranks: rank 1 alone receives SIGTERM during step 6 (3 steps an
    epoch, a save every 4 steps, so the newest save before the signal is step 4's). Both
    ranks stop at step 6 (the vote), where every rank's part of the preemption save
    commits before either ends; the attempt is recorded as preempted at step 6, and the
    next launch resumes at step 6 on both ranks and ends with the uninterrupted run's
    weights, bit for bit. Step 6 ends an epoch: Lightning resumes a plain (not resumable)
    dataloader exactly only there."""
    contract = {
        "TASKPOINT_ROOT": root(tmp_path), "TASKPOINT_ACTION": "ddp", "TASKPOINT_RUN_ID": "t",
        "TASKPOINT_SAVE_ON_PREEMPTION": "1", "TASKPOINT_GRACE_PERIOD": "120",
    }
    stopped = torchrun(
        tmp_path, "--every", "4", "--sigterm-at", "5", "--sigterm-rank", "1",
        TASKPOINT_ATTEMPT="0", **contract,
    )
    assert stopped.returncode != 0, why(stopped)
    assert ends(stopped) == {0: (6, "Preempted"), 1: (6, "Preempted")}, why(stopped)
    assert "SIGTERM received: stopped at step 6" in stopped.stderr, why(stopped)
    assert not (tmp_path / "final.pt").exists() and not (tmp_path / "final-rank1.pt").exists()
    newest = taskpoint.Checkpoint(f"{root(tmp_path)}/ddp/t").committed()[0]
    assert (newest.step, newest.preemption) == (6, True)
    assert newest.parts is not None and sorted(newest.parts) == ["0", "1"]
    ended = [(r.attempt, r.outcome, r.step, r.preemption_save) for r in records(tmp_path, "ddp/t")]
    assert ended == [(0, "preempted", 6, "committed")]  # rank 0 records it: no runner does

    resumed = torchrun(tmp_path, "--every", "4", TASKPOINT_ATTEMPT="1", **contract)
    assert resumed.returncode == 0, why(resumed)
    assert [[at for _, at in starts(resumed, rank)] for rank in (0, 1)] == [[6], [6]], why(resumed)
    first, second = records(tmp_path, "ddp/t")
    assert second.resumed_step == 6 and steps_lost(first, second.resumed_step) == 0
    for final, reference in zip(results(tmp_path), torchrun_reference, strict=True):
        lib.assert_bitwise_equal(final, reference)


def test_torchrun_exception_on_one_rank_commits_the_upload_in_flight_and_resumes_from_it(
    tmp_path: Path, torchrun_reference: list[dict[str, torch.Tensor]]
) -> None:
    """``torchrun``, two ranks, a save every 3 steps (one an epoch): rank 1 raises during
    step 8, one step after step 6's save, whose upload (every rank's part, stalled 3 s) is
    still in flight. Rank 1's exception waits for its part and the commit before it leaves
    the process; torchrun then tears rank 0 down (SIGTERM, stuck in the step's all-reduce),
    and step 6's checkpoint is in the store. The next launch resumes from it on both ranks
    and ends with the uninterrupted run's weights, bit for bit."""
    contract = {"TASKPOINT_ROOT": root(tmp_path), "TASKPOINT_ACTION": "ddp", "TASKPOINT_RUN_ID": "e"}
    failed = torchrun(
        tmp_path, "--fail-at", "7", "--fail-rank", "1", "--slow-uploads", "3",
        TASKPOINT_ATTEMPT="0", **contract,
    )
    assert failed.returncode != 0, why(failed)
    assert "planned failure at step 7" in failed.stderr, why(failed)
    assert "COMMITTED 3 rank 1" in failed.stdout, why(failed)  # step 6 still in flight
    assert ends(failed)[1] == (7, "Planned"), why(failed)
    newest = taskpoint.Checkpoint(f"{root(tmp_path)}/ddp/e").committed()[0]
    assert newest.step == 6, why(failed)
    assert newest.parts is not None and sorted(newest.parts) == ["0", "1"]

    resumed = torchrun(tmp_path, TASKPOINT_ATTEMPT="1", **contract)
    assert resumed.returncode == 0, why(resumed)
    assert [[at for _, at in starts(resumed, rank)] for rank in (0, 1)] == [[6], [6]], why(resumed)
    assert {r.attempt: r.resumed_step for r in records(tmp_path, "ddp/e")}[1] == 6
    for final, reference in zip(results(tmp_path), torchrun_reference, strict=True):
        lib.assert_bitwise_equal(final, reference)

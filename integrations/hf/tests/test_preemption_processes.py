"""Issue #25 with real processes: ``torchrun`` with two CPU ranks, and a process SIGKILLed
while its upload may still run. Each launch is a new attempt under the environment
contract (torchrun's job identity); the resume step is read from the attempt records.
The two-node cases are in ``test_nodes.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import taskpoint_hf_testkit as kit
import torch
from taskpoint import Checkpoint

CHILD = Path(__file__).with_name("taskpoint_hf_child.py")
pytestmark = pytest.mark.slow


def _launch(
    store: str, work: Path, *extra: str, ranks: int = 2, **env: str
) -> subprocess.CompletedProcess[str]:
    """The child under ``torchrun`` with ``ranks`` CPU processes (or alone, ``ranks=0``)."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        if ranks else [sys.executable]
    )
    command = [
        *launcher, str(CHILD), "--store", store, "--work", str(work), "--recipes", "classifier",
        *extra,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    return subprocess.run(command, capture_output=True, text=True, timeout=500, env=environment)


def _why(done: subprocess.CompletedProcess[str]) -> str:
    """The end of stderr, without DDP's warning lines: the workers' errors and torchrun's
    account of how each worker ended (a signal shows only there)."""
    lines = [line for line in done.stderr.splitlines() if "reducer.cpp" not in line]
    return "\n".join(lines)[-6000:]


_EXIT_ABORT = "terminate called without an active exception"
"""What a torchrun worker prints when gloo's teardown at interpreter exit aborts it."""


def _assert_finished(done: subprocess.CompletedProcess[str], work: Path) -> None:
    """The launch trained to the end: exit status 0, or, under torchrun, a worker aborted
    at interpreter exit after every rank had written its result. That abort is PyTorch's
    (a gloo worker thread freeing a finished collective's tensors after the interpreter
    began to finalize; the Trainer alone under torchrun, without taskpoint, aborts the
    same way about one run in ten); it comes after everything the tests check."""
    if done.returncode == 0:
        return
    results = [work / "results" / f"classifier-rank{rank}.pt" for rank in (0, 1)]
    assert _EXIT_ABORT in done.stderr and all(r.exists() for r in results), _why(done)


def _load(path: Path) -> kit.Result:
    return kit.Result.from_dict(torch.load(path, weights_only=False))


def test_torchrun_sigterm_on_one_rank_stops_both_at_one_step_saves_and_resumes_there_exactly(
    tmp_path: Path,
) -> None:
    """Rank 1 alone receives SIGTERM after step 7: both ranks stop at step 8 (the vote),
    commit checkpoint-8 with each rank's files, and end preempted; the next launch resumes
    at step 8 on both ranks and ends as the uninterrupted run."""
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"
    switch = {"TASKPOINT_SAVE_ON_PREEMPTION": "1"}
    first = _launch(store, work, "--reference", "--plain", "--sigterm", "classifier:7", **switch)
    assert first.returncode != 0, _why(first)
    assert "training stopped at step 8: checkpoint-8 committed" in first.stderr, _why(first)
    assert not (work / "results" / "classifier-rank0.pt").exists()
    (newest,) = Checkpoint(f"{store}/classifier").committed()[:1]
    assert (newest.step, newest.preemption) == (8, True)
    assert newest.parts is not None and "checkpoint-8/rng_state_1.pth" in newest.parts["0"]

    second = _launch(store, work, "--plain", **switch)
    _assert_finished(second, work)
    for rank in (0, 1):
        assert f"rank {rank}: classifier resumed from {work / 'classifier' / 'checkpoint-8'}" \
            in second.stdout
        kit.assert_same_run(
            _load(work / "results" / f"classifier-rank{rank}.pt"),
            _load(work / "results" / f"classifier-reference-rank{rank}.pt"),
        )
    first_attempt, second_attempt = kit.attempts(f"{store}/classifier")
    # outside a task rank 0 records the preempted end itself
    assert (first_attempt.outcome, first_attempt.step, first_attempt.preemption_save) == (
        "preempted", 8, "committed"
    )
    assert second_attempt.resumed_step == 8


def test_torchrun_exception_one_step_after_a_save_resumes_from_that_save(tmp_path: Path) -> None:
    """Rank 1 raises at step 7 while checkpoint-6's multi-writer upload is held for 3 s on
    both ranks: rank 1 waits for it before its exception leaves ``train()`` (rank 0's part
    goes on in its upload thread), so the commit lands and the next launch resumes at 6."""
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"
    marker = tmp_path / "uploading"
    first = _launch(
        store, work, "--slow-upload", f"{marker}:3", "--stop", "classifier:7:step_end:raise"
    )
    assert first.returncode != 0, _why(first)
    assert "simulated failure at step 7" in first.stderr
    assert marker.exists(), "checkpoint-6's upload was never held"

    second = _launch(store, work, "--plain")
    _assert_finished(second, work)
    for rank in (0, 1):
        assert f"rank {rank}: classifier resumed from {work / 'classifier' / 'checkpoint-6'}" \
            in second.stdout, second.stdout
    assert kit.attempts(f"{store}/classifier")[-1].resumed_step == 6


def test_torchrun_sigkill_two_steps_after_a_save_resumes_every_rank_from_the_last_commit(
    tmp_path: Path,
) -> None:
    """Multi-writer background uploads, steps of about a second from step 4: rank 1 is
    SIGKILLed at the end of step 8, two steps after checkpoint-6, and torchrun tears rank 0
    down. The next launch resumes both ranks from the newest checkpoint the killed launch
    committed, checkpoint-6 (its upload had two steps to land), and ends as the
    uninterrupted run."""
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"
    first = _launch(
        store, work, "--reference", "--plain", "--pause", "4:1.0",
        "--stop", "classifier:8:step_end:kill",
    )
    assert first.returncode != 0, _why(first)
    assert "Signal 9 (SIGKILL)" in first.stderr, _why(first)
    assert not (work / "results" / "classifier-rank0.pt").exists()
    killed = [m.step for m in Checkpoint(f"{store}/classifier").committed()]  # newest first
    assert killed[:1] == [6], killed

    second = _launch(store, work, "--plain")
    _assert_finished(second, work)
    for rank in (0, 1):
        assert f"rank {rank}: classifier resumed from {work / 'classifier' / 'checkpoint-6'}" \
            in second.stdout, second.stdout
        kit.assert_same_run(
            _load(work / "results" / f"classifier-rank{rank}.pt"),
            _load(work / "results" / f"classifier-reference-rank{rank}.pt"),
        )
    assert [a.resumed_step for a in kit.attempts(f"{store}/classifier")] == [None, 6]


def test_sigkill_two_steps_after_the_first_save_resumes_from_it(tmp_path: Path) -> None:
    """One process, background uploads, steps of about a second: SIGKILL at the end of step
    5 finds checkpoint-3 (the first save, whose upload starts the upload machinery)
    committed, and the next attempt resumes from it."""
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"
    first = _launch(
        store, work, "--plain", "--pause", "4:1.0", "--stop", "classifier:5:step_end:kill",
        ranks=0, TASKPOINT_ACTION="hf-kill",
    )
    assert first.returncode == -9, _why(first)
    second = _launch(store, work, "--plain", ranks=0, TASKPOINT_ACTION="hf-kill")
    assert second.returncode == 0, _why(second)
    assert f"classifier resumed from {work / 'classifier' / 'checkpoint-3'}" in second.stdout
    assert kit.attempts(f"{store}/classifier")[-1].resumed_step == 3

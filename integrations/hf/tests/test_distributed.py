"""torchrun with two CPU processes: only rank zero uploads, every rank resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import taskpoint_hf_testkit as kit
import torch

CHILD = Path(__file__).with_name("taskpoint_hf_child.py")


def _torchrun(store: str, work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(CHILD), "--store", store, "--work", str(work), "--recipes", "classifier", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)


def _load(path: Path) -> kit.Result:
    return kit.Result.from_dict(torch.load(path, weights_only=False))


@pytest.mark.slow
def test_torchrun_rank_zero_uploads_and_every_rank_resumes(tmp_path: Path) -> None:
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"

    # Launch 1: an uninterrupted reference, then the checkpointed run, until rank 1 dies at
    # step 7 and torchrun tears the job down.
    killed = _torchrun(store, work, "--reference", "--stop", "classifier:7:step_end")
    assert killed.returncode != 0
    assert not list((work / "results").glob("classifier-rank*.pt")), killed.stderr[-3000:]

    # Launch 2: both ranks restore checkpoint-6 and finish.
    finished = _torchrun(store, work)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for rank in (0, 1):
        resumed = work / "classifier" / "checkpoint-6"
        assert f"rank {rank}: classifier resumed from {resumed}" in finished.stdout
        result = _load(work / "results" / f"classifier-rank{rank}.pt")
        reference = _load(work / "results" / f"classifier-reference-rank{rank}.pt")
        kit.assert_same_run(result, reference)

    # Only rank zero loaded (once a launch) and saved, after every rank had written its RNG
    # state into checkpoint-N.
    assert kit.read_log(work / "calls-rank1.jsonl", "load") == []
    assert kit.read_log(work / "calls-rank1.jsonl", "save") == []
    assert len(kit.read_log(work / "calls-rank0.jsonl", "load")) == 2
    saves = kit.read_saves(work / "calls-rank0.jsonl")
    assert [entry["newest"] for entry in saves] == [3, 6, 9, 12]
    for entry in saves:
        files = entry["checkpoints"][f"checkpoint-{entry['newest']}"]
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= set(files)
    attempts = sorted(
        p.name for p in (tmp_path / "store" / "classifier" / "attempts").iterdir()
        if p.name.isdigit()  # the claim markers, not the attempts' other records
    )
    assert attempts == ["000000", "000001"]  # one per launch: rank 1 never claimed one


@pytest.mark.slow
def test_under_torchrun_save_on_exception_saves_nothing_and_says_why(tmp_path: Path) -> None:
    """A rank's exception cannot be saved at (the other ranks are not at the failure to run
    the save's collectives): the failing rank says so, nothing newer than checkpoint-3 is
    written, and the next launch resumes there."""
    store, work = f"file://{tmp_path / 'store'}", tmp_path / "work"
    failed = _torchrun(
        store, work, "--plain", "--save-on-exception", "--stop", "classifier:5:step_end:raise"
    )
    assert failed.returncode != 0
    assert (
        "no checkpoint at the failure (Interrupt): under torch.distributed a failing rank "
        "cannot run a save's collectives" in failed.stderr
    ), failed.stderr[-3000:]
    assert sorted(p.name for p in (work / "classifier").glob("checkpoint-*")) == ["checkpoint-3"]

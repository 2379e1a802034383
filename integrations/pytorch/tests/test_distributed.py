"""Real torchrun jobs on CPU with gloo: a worker killed mid-run resumes every rank exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).parent / "tp_torch_ddp_worker.py"
TORCHRUN = [
    sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
    "--nproc_per_node=2", "--monitor-interval=0.2",
]

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _torchrun(env: dict[str, str], *args: str, restarts: int = 0) -> None:
    # A restarted group can read the previous group's gloo addresses from the rendezvous
    # store torchrun shares with its workers (pytorch/pytorch#135712); a store per round
    # avoids that.
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(
        [*TORCHRUN, f"--max-restarts={restarts}", str(WORKER), *args],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def _events(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"events-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory: pytest.TempPathFactory, child_env: dict[str, str]) -> Path:
    """One torchrun job: rank 1 dies before step 10 (third epoch; 4 steps per epoch per
    rank), torchrun restarts the group, which resumes and finishes, then trains again
    uninterrupted as reference, then runs the failure scenarios. Returns its output dir."""
    out = tmp_path_factory.mktemp("torchrun")
    _torchrun(
        child_env, f"file://{out / 'store'}", str(out), "--kill-rank", "1", "--kill-step", "10",
        restarts=2,
    )
    return out


@pytest.mark.slow
def test_torchrun_worker_killed_mid_run_resumes_every_rank_exactly(
    lib: Any, killed_job: Path
) -> None:
    events = {rank: _events(killed_job, rank) for rank in (0, 1)}
    resumes = {
        rank: [(e["epoch"], e["step"]) for e in events[rank] if e["event"] == "resume"]
        for rank in (0, 1)
    }
    for rank in (0, 1):
        starts = [e["restart"] for e in events[rank] if e["event"] == "start"]
        assert starts[:2] == [0, 1], f"rank {rank}: torchrun restarted the group"
        # The first run starts fresh; every restart (one, unless the group itself failed
        # to form again) resumes from the last commit before the kill: epoch 2, step 8.
        assert resumes[rank][0] == (None, None)
        assert resumes[rank][1:] and set(resumes[rank][1:]) == {(2, 8)}, resumes
    assert resumes[0] == resumes[1], "every rank resumed from the same step"

    # Only rank 0 ever called the store's save, and only rank 0 processes claimed attempts.
    assert [e for e in events[1] if e["event"] == "save"] == []
    rank0_pids = {e["pid"] for e in events[0]}
    assert len([e for e in events[0] if e["event"] == "save"]) == 2 + 2
    markers = sorted(  # the claim markers, not the run history's .resume/.end records
        m for m in (killed_job / "store" / "attempts").iterdir() if m.name.isdigit()
    )
    assert len(markers) >= 2
    assert {json.loads(m.read_text())["pid"] for m in markers} <= rank0_pids

    expected = torch.load(killed_job / "reference-rank0.pt", weights_only=True)
    assert expected["step"] == 16
    for rank in (0, 1):
        assert lib.bitwise_differences(
            torch.load(killed_job / f"reference-rank{rank}.pt", weights_only=True), expected
        ) == [], "the uninterrupted replicas agree"
        got = torch.load(killed_job / f"final-rank{rank}.pt", weights_only=True)
        assert lib.bitwise_differences(got, expected) == [], f"rank {rank}"


@pytest.mark.slow
def test_torchrun_failures_on_one_rank_stop_every_rank(killed_job: Path) -> None:
    r0 = json.loads((killed_job / "errors-rank0.json").read_text())
    r1 = json.loads((killed_job / "errors-rank1.json").read_text())

    assert r0["private-save"] == r1["private-save"] == "ok"
    for outcome in (r0["private-restore"], r1["private-restore"]):
        assert outcome.startswith("StateError: ranks restored different checkpoints")
        assert "rank 1: nothing" in outcome and "memory://" in outcome

    assert r0["rank0-store-fails"] == "RuntimeError: store unavailable (simulated)"
    assert r1["rank0-store-fails"].startswith("StateError: rank 0 failed to save the checkpoint")
    assert "store unavailable" in r1["rank0-store-fails"]

    assert r0["rank0-bad-extra"].startswith("TypeError: extra['loss'] is a numpy.float64")
    assert r1["rank0-bad-extra"].startswith("StateError: rank 0 failed to save")

    assert r0["good-save"] == r1["good-save"] == "ok"
    assert r1["rank1-load-fails"] == "RuntimeError: download failed (simulated)"
    assert r0["rank1-load-fails"].startswith("StateError: cannot restore the state: rank 1 failed")
    assert r0["good-restore"] == r1["good-restore"] == "ok"

    assert r0["bg-store-fails"] == r1["bg-store-fails"] == "ok"  # returned before the upload
    assert r0["bg-next-save"] == "RuntimeError: store unavailable (simulated)"
    assert r1["bg-next-save"].startswith("StateError: cannot save the state: rank 0 failed")
    assert "store unavailable" in r1["bg-next-save"]
    assert r0["bg-good-save"] == r1["bg-good-save"] == "ok"
    assert r0["bg-wait"] == r1["bg-wait"] == "ok"
    assert r0["bg-restored-epoch"] == r1["bg-restored-epoch"] == "5"

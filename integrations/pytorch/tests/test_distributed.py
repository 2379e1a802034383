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


@pytest.mark.slow
def test_torchrun_worker_killed_mid_run_resumes_every_rank_exactly(
    lib: Any, tmp_path: Path, child_env: dict[str, str]
) -> None:
    killed = tmp_path / "killed"
    killed.mkdir()
    store = tmp_path / "store"
    # 4 steps per epoch per rank: rank 1 dies before step 10, in the third epoch. When the
    # restarted group is done, the same processes also train uninterrupted, as reference.
    _torchrun(
        child_env, "train", f"file://{store}", str(killed),
        "--kill-rank", "1", "--kill-step", "10", restarts=2,
    )

    events = {rank: _events(killed, rank) for rank in (0, 1)}
    for rank in (0, 1):
        starts = [e["restart"] for e in events[rank] if e["event"] == "start"]
        resumes = [(e["epoch"], e["step"]) for e in events[rank] if e["event"] == "resume"]
        assert starts == [0, 1], f"rank {rank}: torchrun restarted the group once"
        assert resumes == [(None, None), (2, 8)], f"rank {rank} resumed from the last commit"

    # Only rank 0 ever called the store's save, and only rank 0 processes claimed attempts.
    assert [e for e in events[1] if e["event"] == "save"] == []
    rank0_pids = {e["pid"] for e in events[0]}
    assert len([e for e in events[0] if e["event"] == "save"]) == 2 + 2
    markers = sorted((store / "attempts").iterdir())
    assert len(markers) == 2
    assert {json.loads(m.read_text())["pid"] for m in markers} <= rank0_pids

    expected = torch.load(killed / "reference-rank0.pt", weights_only=True)
    assert expected["step"] == 16
    for rank in (0, 1):
        assert lib.bitwise_differences(
            torch.load(killed / f"reference-rank{rank}.pt", weights_only=True), expected
        ) == [], "the uninterrupted replicas agree"
        got = torch.load(killed / f"final-rank{rank}.pt", weights_only=True)
        assert lib.bitwise_differences(got, expected) == [], f"rank {rank}"


@pytest.mark.slow
def test_torchrun_failures_on_one_rank_stop_every_rank(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    _torchrun(child_env, "errors", f"file://{tmp_path / 'store'}", str(tmp_path))
    r0 = json.loads((tmp_path / "errors-rank0.json").read_text())
    r1 = json.loads((tmp_path / "errors-rank1.json").read_text())

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

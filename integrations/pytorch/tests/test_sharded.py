"""Sharded checkpoints under real torchrun jobs (CPU, gloo): FSDP2, DCP, resharding.

One 2-rank job trains an FSDP2 model with AdamW and a sharded ``TaskpointState``; rank 1
SIGKILLs itself in the middle of a save (its shards uploaded, nothing committed), torchrun
restarts the group, which resumes from the previous commit; there rank 0 SIGKILLs itself
mid-epoch, and the third incarnation resumes again and finishes; then the same
processes train uninterrupted as reference and run the DCP scenarios. Jobs of 1 and 3 ranks
then restore what the 2 ranks saved.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).parent / "tp_torch_fsdp_worker.py"

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]


def _torchrun(
    env: dict[str, str], nproc: int, *args: str, restarts: int = 0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={nproc}", "--monitor-interval=0.2", f"--max-restarts={restarts}",
            str(WORKER), *args,
        ],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, child_env: dict[str, str]) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    _torchrun(
        child_env, 2, "train", f"file://{out / 'store'}", str(out),
        "--kill-rank", "1", "--kill-epoch", "3", "--then-kill-rank", "0",
        "--then-kill-epoch", "4", restarts=2,
    )
    return out


def _events(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"events-rank{rank}.jsonl").read_text().splitlines()]


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def test_fsdp2_killed_mid_save_and_mid_run_resumes_exactly(lib: Any, job: Path) -> None:
    for rank in (0, 1):
        events = _events(job, rank)
        assert [e["restart"] for e in events if e["event"] == "start"] == [0, 1, 2]
        # The save of epoch 3 died after rank 1 uploaded its shards: it never committed, so
        # the first restart resumes after epoch 2; rank 0 died in epoch 4, after epoch 3's
        # commit.
        assert [e["epoch"] for e in events if e["event"] == "resume"] == [None, 2, 3]
    final, reference = _load(job / "final.pt"), _load(job / "reference.pt")
    assert final["optimizer"]["state"], "AdamW has state to compare"
    assert lib.bitwise_differences(final, reference) == []


def test_every_commit_holds_both_ranks_parts(job: Path) -> None:
    import taskpoint

    manifests = taskpoint.Checkpoint(f"file://{job / 'store'}").committed()
    assert manifests, "committed"
    newest = manifests[0]
    assert newest.parts is not None and sorted(newest.parts) == ["0", "1"]
    assert any(p.endswith(".distcp") for p in newest.parts["1"])
    assert ".metadata" in newest.parts["0"] and ".metadata" not in newest.parts["1"]
    assert newest.stats is not None and newest.stats["writers"] == 2


def _files(url: str) -> dict[str, int]:
    """The newest checkpoint's files and their sizes."""
    import taskpoint

    newest = taskpoint.Checkpoint(url).committed()[0]
    return {e.path: e.size for e in newest.entries or () if e.type == "file"}


def _check_fetched(
    loads: list[dict[str, Any]], files: dict[str, int], *, sizes: bool = True
) -> list[str]:
    """A reader's two restores: ``.metadata`` alone, then it and the plan's shard files
    (asked for and held, nothing else, of ``files``' sizes); the shard files of the second."""
    assert [load["paths"] for load in loads[:1]] == [[".metadata"]], loads
    assert loads[0]["files"] == [".metadata"]
    assert len(loads) == 2, loads
    fetched = loads[1]["files"]
    assert loads[1]["paths"] == fetched and ".metadata" in fetched
    assert set(fetched) <= set(files)
    if sizes:
        assert loads[1]["bytes"] == sum(files[f] for f in fetched)
    return [f for f in fetched if f != ".metadata"]


def test_a_resume_on_the_same_world_size_fetches_its_own_shards(job: Path) -> None:
    files = _files(f"file://{job / 'store'}")
    shards = sorted(f for f in files if f.endswith(".distcp"))
    assert len(shards) == 2
    for rank in (0, 1):
        resumes = [e for e in _events(job, rank) if e["event"] == "resume" and e["epoch"]]
        assert resumes
        for resume in resumes:
            # Its own shards; another rank's too only for the values DCP stored once (the
            # rest of the bundle, optimizer steps), which one rank wrote for all. The resumes
            # loaded older commits than the newest: same names, perhaps other sizes.
            assert shards[rank] in _check_fetched(resume["loads"], files, sizes=False)


@pytest.mark.parametrize("nproc", [1, 3])
def test_state_saved_by_two_ranks_restores_on_other_world_sizes(
    lib: Any, job: Path, child_env: dict[str, str], nproc: int
) -> None:
    _torchrun(child_env, nproc, "reshard", f"file://{job / 'store'}", str(job))
    got = _load(job / f"reshard-{nproc}.pt")
    assert got.pop("epoch") == 4
    assert lib.bitwise_differences(got, _load(job / "final.pt")) == []
    files = _files(f"file://{job / 'store'}")
    shards = {f for f in files if f.endswith(".distcp")}
    fetched = {}
    for rank in range(nproc):
        report = json.loads((job / f"reshard-{nproc}-rank{rank}.json").read_text())
        fetched[rank] = _check_fetched(report["loads"], files)
        assert len(report["log"]) == 1 and (
            f"rank {rank} fetched .metadata and {len(fetched[rank])} of the 2 shard files"
        ) in report["log"][0]
    if nproc == 1:  # one rank holds everything: it needs every rank's shards
        assert sorted(fetched[0]) == sorted(shards)
    else:  # the ranks between them read every shard file, whichever rank wrote it
        assert set().union(*fetched.values()) == shards


def test_dcp_save_async_save_and_load_go_through_taskpoint(job: Path) -> None:
    for rank in (0, 1):
        outcomes = json.loads((job / f"dcp-rank{rank}.json").read_text())
        assert outcomes["save"] == "ok"
        assert outcomes["async-then-load"] == "equal=True parts=['0', '1'] commits=1"
        # Same world size, sharding and model only: each rank fetched .metadata and its own
        # shard file, never the other rank's.
        files = _files(f"file://{job / 'dcp-store'}")
        assert sorted(f for f in files if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert _check_fetched(outcomes["load-fetched"], files) == [f"__{rank}_0.distcp"]
        assert len(outcomes["load-log"]) == 1
        assert f"rank {rank} fetched .metadata and 1 of the 2 shard files" in outcomes["load-log"][0]


def test_dcp_ranks_disagreeing_about_location_fail_before_upload(job: Path) -> None:
    for rank in (0, 1):
        outcomes = json.loads((job / f"dcp-rank{rank}.json").read_text())
        assert "ranks disagree about the checkpoint location" in outcomes["disagree"]
        assert "disagree-0" in outcomes["disagree"] and "disagree-1" in outcomes["disagree"]
        assert outcomes["disagree-uploaded"] == [] and outcomes["disagree-committed"] == 0
        assert outcomes["disagree-leases"] == 0


def test_dcp_one_rank_failing_fails_every_rank_and_commits_nothing(job: Path) -> None:
    for rank in (0, 1):
        outcomes = json.loads((job / f"dcp-rank{rank}.json").read_text())
        assert "store unavailable (simulated)" in outcomes["rank1-upload-fails"]
        assert outcomes["rank1-upload-fails-seconds"] < 60
        assert outcomes["rank1-upload-fails-committed"] == 0
        assert outcomes["rank1-upload-fails-leases"] == 0


def test_torch_coordinator_parts_conflict_and_partial_restore(job: Path) -> None:
    for rank in (0, 1):
        outcomes = json.loads((job / f"dcp-rank{rank}.json").read_text())
        assert "ranks 0 and 1 both wrote 'shared.txt' with different content" in outcomes["conflict"]
        assert outcomes["parts-ok"] == "ok"
        assert outcomes["part-files"] == [f"own-{rank}.txt", "shared.txt"]


def test_a_rank_that_never_arrives_fails_the_job_in_bounded_time(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    started = time.monotonic()
    proc = _torchrun(
        child_env, 2, "hang", f"file://{tmp_path / 'store'}", str(tmp_path), check=False
    )
    assert proc.returncode != 0
    assert time.monotonic() - started < 120
    outcome = json.loads((tmp_path / "hang-rank0.json").read_text())
    assert "rank(s) [1] of 2 never arrived within 3s" in outcome["error"]
    assert outcome["seconds"] < 30
    assert not (tmp_path / "store" / "checkpoints").exists()

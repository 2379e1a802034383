"""Two nodes without a shared disk: ``torchrun --nnodes=2`` launched twice on loopback, each
from its own working directory, with a relative ``output_dir`` (issue #20)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _servers
import pytest
import taskpoint
import taskpoint_hf_testkit as kit
import torch

CHILD = Path(__file__).with_name("taskpoint_hf_nodes_child.py")
pytestmark = pytest.mark.slow


def _nodes(
    root: Path, stores: tuple[str, str], *extra: str, timeout: float = 400, gpus: bool = False
) -> list[subprocess.CompletedProcess[str]]:
    """Both nodes' torchrun, each in ``root/node<K>``; their completed processes.

    ``gpus``: node K sees only CUDA device K."""
    port = _servers.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launched = []
    for node, store in enumerate(stores):
        cwd = root / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        if gpus:
            env = {**env, "CUDA_VISIBLE_DEVICES": str(node)}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(CHILD), "--store", store, "--results", str(root / "results"), *extra,
        ]
        launched.append(subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        ))
    done = []
    for process in launched:
        out, _ = process.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, ""))
    return done


def _one_disk(root: Path, store: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Both ranks on one node (one shared ``output_dir``): ``torchrun --standalone``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    (root / "shared").mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(CHILD), "--store", store, "--results", str(root / "results"), *extra,
    ]
    return subprocess.run(
        command, cwd=root / "shared", env=env, capture_output=True, text=True, timeout=400
    )


def _load(path: Path) -> kit.Result:
    return kit.Result.from_dict(torch.load(path, weights_only=False))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted two-node run's results (``reference-rank<R>.pt``)."""
    root = tmp_path_factory.mktemp("reference")
    unused = f"file://{root / 'store'}"
    launched = _nodes(root, (unused, unused), "--reference")
    assert all(r.returncode == 0 for r in launched), launched[1].stdout[-3000:]
    return root / "results"


@pytest.mark.parametrize(
    ("store_url", "each_node"),
    [("file", True), ("seaweedfs", False)],  # each a kill and a resume, both nodes twice
    ids=["save_on_each_node", "node0_saves-through_seaweedfs_s3"],
    indirect=["store_url"],
)
def test_killed_two_node_run_resumes_exactly_with_each_nodes_rng(
    tmp_path: Path, reference: Path, store_url: str, each_node: bool
) -> None:
    _killed_and_resumed(tmp_path, reference, store_url, each_node)


def _killed_and_resumed(tmp_path: Path, reference: Path, store: str, each_node: bool) -> None:
    both = (store, store)
    setting = ("--set", f"save_on_each_node={'true' if each_node else 'false'}")

    killed = _nodes(tmp_path, both, "--stop", "7", *setting)  # rank 1 dies at step 7
    assert any(r.returncode != 0 for r in killed)
    assert not list((tmp_path / "results").glob("run-rank*.pt"))

    for node in (0, 1):  # the nodes' disks are gone: a fresh machine each
        for leftover in (tmp_path / f"node{node}" / "out").glob("checkpoint-*"):
            subprocess.run(["rm", "-rf", str(leftover)], check=True)

    finished = _nodes(tmp_path, both, *setting)
    for node, launch in enumerate(finished):
        assert launch.returncode == 0, launch.stdout[-3000:]
        # each node resumed from its own restored copy, which held its rank's RNG state
        # (restore_last_checkpoint warns when it does not)
        assert f"rank {node}: resumed from out/checkpoint-6" in launch.stdout
        assert "TaskpointWarning" not in launch.stdout, launch.stdout[-3000:]
    _assert_each_node_got_its_own_files(tmp_path / "results")
    assert _resumed_steps(store) == [6]  # the second launch's attempt, in the records
    for rank in (0, 1):
        kit.assert_same_run(
            _load(tmp_path / "results" / f"run-rank{rank}.pt"),
            _load(reference / f"reference-rank{rank}.pt"),
        )
    # the store's newest checkpoint holds both nodes' files, written once
    newest = taskpoint.Checkpoint(store).load_sync()
    assert newest is not None and newest.name == "out"
    files = {p.name for p in (newest / "checkpoint-12").iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= files
    assert not [p for p in newest.iterdir() if p.name.startswith(".taskpoint-")]


SHARED = {
    "config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
    "training_args.bin",
}
"""What every rank's Trainer reads of a ``checkpoint-N``, whichever node uploaded it."""


def _assert_each_node_got_its_own_files(results: Path) -> None:
    """Each node's restore (listed before training began) brought the shared files and its
    own rank's RNG state, not the other node's."""
    listed = [
        set(json.loads((results / f"restored-rank{rank}.json").read_text())) for rank in (0, 1)
    ]
    for rank, files in enumerate(listed):
        for step in (3, 6):  # save_total_limit=2: the two newest
            names = {p.split("/", 1)[1] for p in files if p.startswith(f"checkpoint-{step}/")}
            assert names >= SHARED, (rank, sorted(names))
            assert f"rng_state_{rank}.pth" in names, (rank, sorted(names))
            assert f"rng_state_{1 - rank}.pth" not in names, (rank, sorted(names))
    # the same files on both nodes, but for each rank's RNG state
    assert {p for p in listed[0] if "rng_state_0" not in p} == {
        p for p in listed[1] if "rng_state_1" not in p
    }


def _resumed_steps(store: str) -> list[int | None]:
    """The step each attempt that loaded a checkpoint resumed at, from the records."""
    return [a.resumed_step for a in kit.attempts(store) if a.resumed_from is not None]


def test_an_exception_one_step_after_a_save_on_two_nodes_resumes_from_that_save(
    tmp_path: Path, reference: Path
) -> None:
    """Rank 1 (node 1) raises at step 7 while checkpoint-6's multi-writer upload is held for
    3 s on both nodes: its exception leaves ``train()`` only once that commit has landed
    (rank 0's part goes on in its upload thread meanwhile), so the next launch resumes at
    step 6, not 3."""
    store = f"file://{tmp_path / 'store'}"
    failed = _nodes(tmp_path, (store, store), "--raise-at", "7", "--slow-upload", "3")
    assert any(r.returncode != 0 for r in failed)
    assert "simulated failure at step 7" in failed[1].stdout, failed[1].stdout[-3000:]
    assert (tmp_path / "results" / "slow-upload-rank1").exists(), "the upload was never held"
    for node in (0, 1):  # the nodes' disks are gone: a fresh machine each
        subprocess.run(["rm", "-rf", str(tmp_path / f"node{node}" / "out")], check=True)

    finished = _nodes(tmp_path, (store, store))
    for node, launch in enumerate(finished):
        assert launch.returncode == 0, launch.stdout[-3000:]
        assert f"rank {node}: resumed from out/checkpoint-6" in launch.stdout
    assert _resumed_steps(store) == [6]
    for rank in (0, 1):
        kit.assert_same_run(
            _load(tmp_path / "results" / f"run-rank{rank}.pt"),
            _load(reference / f"reference-rank{rank}.pt"),
        )


def test_a_restore_failing_on_node_1_fails_every_rank_promptly(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    started = time.monotonic()
    failed = _nodes(tmp_path, (store, store), "--fail-restore", timeout=300)
    took = time.monotonic() - started
    for node, launch in enumerate(failed):
        assert launch.returncode != 0, launch.stdout[-3000:]
        assert f"rank {node}: error" in launch.stdout, launch.stdout[-3000:]
        assert "node 1 cannot read the store" in launch.stdout
    assert took < 200


def test_ranks_naming_different_checkpoints_fail_before_any_upload(tmp_path: Path) -> None:
    stores = (f"file://{tmp_path / 'store-a'}", f"file://{tmp_path / 'store-b'}")
    failed = _nodes(tmp_path, stores, timeout=300)
    for node, launch in enumerate(failed):
        assert launch.returncode != 0, launch.stdout[-3000:]
        assert f"rank {node}: error" in launch.stdout, launch.stdout[-3000:]
        assert "disagree about the checkpoint location" in launch.stdout
    for name in ("store-a", "store-b"):
        stored = tmp_path / name
        assert not stored.exists() or not list(stored.rglob("*.manifest.json"))
        assert not (stored / "objects").exists()


def test_a_shared_disk_is_uploaded_once_and_restored_once(tmp_path: Path, reference: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    killed = _one_disk(tmp_path, store, "--stop", "7")
    assert killed.returncode != 0
    finished = _one_disk(tmp_path, store)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: resumed from out/checkpoint-6" in finished.stdout
        kit.assert_same_run(
            _load(tmp_path / "results" / f"run-rank{rank}.pt"),
            _load(reference / f"reference-rank{rank}.pt"),
        )
    # rank 0 staged the shared output_dir, rank 1 nothing: no file uploaded twice
    newest = taskpoint.Checkpoint(store).committed()[0]
    assert newest.parts is not None and newest.parts["1"] == ()
    assert "checkpoint-12/rng_state_1.pth" in newest.parts["0"]


@pytest.mark.gpu
def test_fsdp_sharded_state_dict_on_two_nodes_resumes_exactly(tmp_path: Path) -> None:
    """FSDP2 with ``SHARDED_STATE_DICT``, one GPU per node, no shared disk: each rank's
    model and optimizer shards reach the store from its own node and come back to it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one per node; NCCL refuses two ranks on one)")
    store = f"file://{tmp_path / 'store'}"
    unused = f"file://{tmp_path / 'unused'}"
    reference = _nodes(tmp_path, (unused, unused), "--reference", "--fsdp", gpus=True)
    assert all(r.returncode == 0 for r in reference), reference[1].stdout[-3000:]
    killed = _nodes(tmp_path, (store, store), "--stop", "7", "--fsdp", gpus=True)
    assert any(r.returncode != 0 for r in killed)
    for node in (0, 1):  # the nodes' disks are gone: a fresh machine each
        subprocess.run(["rm", "-rf", str(tmp_path / f"node{node}" / "out")], check=True)

    finished = _nodes(tmp_path, (store, store), "--fsdp", gpus=True)
    for node, launch in enumerate(finished):
        assert launch.returncode == 0, launch.stdout[-3000:]
        assert f"rank {node}: resumed from out/checkpoint-6" in launch.stdout
    for rank in (0, 1):
        kit.assert_same_run(
            _load(tmp_path / "results" / f"run-rank{rank}.pt"),
            _load(tmp_path / "results" / f"reference-rank{rank}.pt"),
        )
    newest = taskpoint.Checkpoint(store).committed()[0]
    assert newest.parts is not None
    shards = [name for name in newest.parts["1"] if name.startswith("checkpoint-12/")]
    assert any(name.endswith("__1_0.distcp") for name in shards), newest.parts["1"]

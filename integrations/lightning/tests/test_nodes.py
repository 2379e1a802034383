"""Two nodes without a shared disk: ``torchrun --nnodes=2`` launched twice on loopback, each
from its own working directory, with a relative ``dirpath`` (issue #20), DDP on CPU; and a
restore that fails on one node failing both, promptly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _servers
import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch
from taskpoint.format.history import read_attempts
from taskpoint.store.store import Store

SCRIPT = Path(__file__).with_name("nodes_script.py")
pytestmark = pytest.mark.slow


def _own_disks_supported() -> bool:
    try:
        probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


requires_own_disks = pytest.mark.skipif(
    not _own_disks_supported(),
    reason="needs `unshare --mount` (root or user namespaces) to give each node its own disk",
)


def _nodes(
    root: Path, store: str, *extra: str, timeout: float = 400, own_disks: bool = True,
    gpus: bool = False,
) -> list[subprocess.CompletedProcess[str]]:
    """Both nodes' torchrun and their completed processes.

    With ``own_disks`` each node runs in its own mount namespace, where ``root/disk`` is
    its own folder ``root/node<K>``: the same absolute path, as on two machines, but
    another disk each. (Lightning makes ``dirpath`` absolute on rank 0 and hands that path
    to every rank, so two working directories alone would leave the nodes sharing one
    disk.) Without, node K just runs in ``root/node<K>``. ``gpus``: node K sees only CUDA
    device K.
    """
    port = _servers.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    disk = root / "disk"
    disk.mkdir(parents=True, exist_ok=True)  # where each node's own disk is mounted
    launched = []
    for node in (0, 1):
        own = root / f"node{node}"
        own.mkdir(parents=True, exist_ok=True)
        if gpus:
            env = {**env, "CUDA_VISIBLE_DEVICES": str(node)}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(SCRIPT), store, str(root / "results"), *extra,
        ]
        if own_disks:
            mounted = 'mount --bind "$1" "$2" && cd "$2" && shift 2 && exec "$@"'
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mounted,
                       "sh", str(own), str(disk), *command]
        launched.append(subprocess.Popen(
            command, cwd=own, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        ))
    done = []
    deadline = time.monotonic() + timeout
    try:
        for process in launched:
            out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
            done.append(subprocess.CompletedProcess(process.args, process.returncode, out, ""))
    except subprocess.TimeoutExpired:
        for process in launched:  # each torchrun and its workers: nothing outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        outputs = [process.communicate()[0][-2000:] for process in launched]
        pytest.fail(f"the nodes still ran after {timeout:g}s: {outputs}")
    return done


@requires_own_disks
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killed_on_two_nodes_resumes_exactly(tmp_path: Path, strategy: str) -> None:
    _killed_and_resumed(tmp_path, strategy)


@requires_own_disks
@pytest.mark.gpu
def test_fsdp_on_two_gpu_nodes_resumes_exactly(tmp_path: Path) -> None:
    """Lightning's own FSDPStrategy and wrapping, NCCL, one GPU per node."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one per node; NCCL refuses two ranks on one)")
    _killed_and_resumed(tmp_path, "fsdp", gpus=True)


def _killed_and_resumed(tmp_path: Path, strategy: str, gpus: bool = False) -> None:
    store = f"file://{tmp_path / 'store'}"
    flags = (["--fsdp"] if strategy == "fsdp" else []) + (["--gpu"] if gpus else [])
    reference = _nodes(tmp_path, store, "--reference", *flags, gpus=gpus)
    assert all(r.returncode == 0 for r in reference), reference[1].stdout[-3000:]

    killed = _nodes(tmp_path, store, "--kill-at", "7", *flags, gpus=gpus)  # 3 steps an epoch
    assert all(r.returncode != 0 for r in killed)
    for node in (0, 1):  # each node's local disk is gone: a fresh machine each
        subprocess.run(["rm", "-rf", str(tmp_path / f"node{node}" / "ckpts")], check=True)

    launches = _nodes(tmp_path, store, *flags, gpus=gpus)
    for node, launch in enumerate(launches):
        assert launch.returncode == 0, launch.stdout[-3000:]
        assert f"rank {node}: STARTED 2 6" in launch.stdout, launch.stdout[-3000:]
    # the records say where the resumed attempt started: step 6, the end of epoch 1
    resumed = {r.attempt: r.resumed_step for r in read_attempts(Store(store))}
    assert resumed == {0: None, 1: 6}
    # every rank took part in each commit, its shards reaching the store from its own node
    newest = taskpoint.Checkpoint(store).committed()[0]
    assert newest.parts is not None and sorted(newest.parts) == ["0", "1"]
    if strategy == "ddp":  # rank 1 wrote nothing: DDP checkpoints are rank 0's
        assert newest.parts["1"] == ()
    else:  # each sharded .ckpt is a folder holding one shard file per rank
        for name in ("last.ckpt", "epoch=4-step=15.ckpt"):
            assert f"{name}/__1_0.distcp" in newest.parts["1"], newest.parts
            assert f"{name}/__0_0.distcp" in newest.parts["0"], newest.parts
            assert f"{name}/.metadata" in newest.parts["0"], newest.parts
    for rank in (0, 1):
        lib.assert_bitwise_equal(
            torch.load(tmp_path / "results" / f"run-rank{rank}.pt"),
            torch.load(tmp_path / "results" / f"reference-rank{rank}.pt"),
        )


def test_a_restore_failing_on_node_1_fails_every_rank_promptly(tmp_path: Path) -> None:
    # resume_ckpt_path runs before Lightning starts the process group: without the gather
    # through torchrun's store, node 0 would wait in init_process_group for 30 minutes
    store = f"file://{tmp_path / 'store'}"
    started = time.monotonic()
    failed = _nodes(tmp_path, store, "--fail-restore", timeout=300, own_disks=False)
    took = time.monotonic() - started
    for node, launch in enumerate(failed):
        assert launch.returncode != 0, launch.stdout[-3000:]
        assert f"rank {node}: error after" in launch.stdout, launch.stdout[-3000:]
        assert "OSError: simulated: node 1 cannot read the store" in launch.stdout
    # node 0 learns which rank failed, where, and why
    assert "CheckpointCoordinationError" in failed[0].stdout, failed[0].stdout[-3000:]
    assert "rank 1 (host " in failed[0].stdout, failed[0].stdout[-3000:]
    assert "STARTED" not in failed[0].stdout + failed[1].stdout
    assert took < 120, took

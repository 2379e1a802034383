"""Two nodes without a shared disk: ``torchrun --nnodes=2`` launched twice on loopback, each
from its own working directory, with a relative ``dirpath`` (issue #20), DDP on CPU; and a
restore that fails on one node failing both, promptly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import taskpoint
import taskpoint_lightning_testlib as lib
import torch

SCRIPT = Path(__file__).with_name("nodes_script.py")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _nodes(
    root: Path, store: str, *extra: str, timeout: float = 400
) -> list[subprocess.CompletedProcess[str]]:
    """Both nodes' torchrun, each in ``root/node<K>``; their completed processes."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    launched = []
    for node in (0, 1):
        cwd = root / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(SCRIPT), store, str(root / "results"), *extra,
        ]
        launched.append(subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


def test_ddp_killed_on_two_nodes_resumes_exactly(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    reference = _nodes(tmp_path, store, "--reference")
    assert all(r.returncode == 0 for r in reference), reference[1].stdout[-3000:]

    killed = _nodes(tmp_path, store, "--kill-at", "7")  # 3 steps an epoch: in epoch 2
    assert all(r.returncode != 0 for r in killed)
    for node in (0, 1):  # each node's local disk is gone: a fresh machine each
        subprocess.run(["rm", "-rf", str(tmp_path / f"node{node}" / "ckpts")], check=True)

    resumed = _nodes(tmp_path, store)
    for node, launch in enumerate(resumed):
        assert launch.returncode == 0, launch.stdout[-3000:]
        assert f"rank {node}: STARTED 2 6" in launch.stdout, launch.stdout[-3000:]
    # every rank took part in each commit (a sharded strategy's shards would reach the
    # store from their own node); rank 1's disk held nothing rank 0's lacked
    newest = taskpoint.Checkpoint(store).committed()[0]
    assert newest.parts is not None and sorted(newest.parts) == ["0", "1"]
    assert newest.parts["1"] == ()
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
    failed = _nodes(tmp_path, store, "--fail-restore", timeout=300)
    took = time.monotonic() - started
    for node, launch in enumerate(failed):
        assert launch.returncode != 0, launch.stdout[-3000:]
        assert f"rank {node}: error after" in launch.stdout, launch.stdout[-3000:]
        assert "CheckpointCoordinationError" in launch.stdout, launch.stdout[-3000:]
        assert "rank 1 (node 1, host" in launch.stdout, launch.stdout[-3000:]
        assert "OSError: simulated: node 1 cannot read the store" in launch.stdout
    assert "STARTED" not in failed[0].stdout + failed[1].stdout
    assert took < 120, took

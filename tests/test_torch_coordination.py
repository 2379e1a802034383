"""Core shares the torch coordinators with every adapter without depending on torch;
``TorchrunCoordinator`` gathers through torchrun's store before any process group."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import _servers
import pytest

GATHERER = Path(__file__).with_name("tp_torchrun_gatherer.py")
HANG_S = 600
"""Bounds a torchrun job (two ranks importing torch, however loaded the machine): only a
hang reaches it."""


def test_importing_taskpoint_and_the_torch_coordinator_module_leaves_torch_unimported() -> None:
    code = (
        "import sys, taskpoint, taskpoint.distributed.torch_coordination\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_a_process_group_it_says_which_coordinator_to_use() -> None:
    from taskpoint.distributed.torch_coordination import TorchCoordinator

    with pytest.raises(RuntimeError, match=r"TorchrunCoordinator.*StoreCoordinator"):
        TorchCoordinator(timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        TorchCoordinator(timeout=0)


_TORCHRUN_VARIABLES = (
    "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
)


def _torchrun(mode: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(GATHERER), mode,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_S, check=False
    )


def test_outside_torchrun_there_is_no_job_coordinator(monkeypatch: pytest.MonkeyPatch) -> None:
    from taskpoint.distributed.torch_coordination import TorchrunCoordinator, torch_job_coordinator

    for name in _TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert torch_job_coordinator(timeout=5) is None
    with pytest.raises(RuntimeError, match="torchrun"):
        TorchrunCoordinator(timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        torch_job_coordinator(timeout=-1)


def test_an_unreachable_torchrun_store_fails_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import taskpoint
    import torch.distributed  # imported before the clock starts: the wait is the store's
    from taskpoint.distributed.torch_coordination import torch_job_coordinator

    assert torch.distributed.is_available()
    port = _servers.free_port()  # a port nothing listens on
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(taskpoint.CheckpointCoordinationError, match=f"127.0.0.1:{port}"):
        torch_job_coordinator(timeout=2)
    assert time.monotonic() - started < 60  # the 2 s timeout, not TCPStore's default 300 s


@pytest.mark.slow
def test_ranks_gather_through_torchruns_store_before_a_process_group(tmp_path: Path) -> None:
    done = _torchrun("ok", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: gathered [{{'rank': 0, 'pid'" in done.stdout
        assert f"rank {rank}: gathered ['second from 0', 'second from 1']" in done.stdout
        assert f"rank {rank}: first round gone True" in done.stdout  # the store is tidied
        # once a process group is up, the job's coordinator is a TorchCoordinator, and
        # closing it destroys its gloo group
        assert f"rank {rank}: grouped [0, 1]" in done.stdout
        assert f"rank {rank}: any rank True False" in done.stdout  # both agree to stop
        assert f"rank {rank}: groups after close 0" in done.stdout


@pytest.mark.slow
def test_a_rank_that_never_gathers_is_named_after_the_timeout(tmp_path: Path) -> None:
    done = _torchrun("missing", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"rank 0: missing \[1\] after ([\d.]+)s own record gone True", done.stdout)
    assert found, done.stdout[-3000:] + done.stderr[-3000:]
    assert 2.5 < float(found.group(1)) < 120  # the 3 s timeout, not a hang
    assert "rank(s) [1] of 2 never arrived" in done.stdout


def test_any_rank_alone_is_the_flag_itself() -> None:
    from taskpoint.distributed.torch_coordination import AnyRank

    vote = AnyRank()
    assert vote(True) is True and vote(False) is False
    vote.close()

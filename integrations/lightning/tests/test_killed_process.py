"""A training process killed outright (os._exit(137)) resumes, in a new process, to the
same final weights as an uninterrupted process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import taskpoint_lightning_testlib as lib
import torch

SCRIPT = Path(__file__).with_name("train_script.py")


def run(store: str, workdir: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), store, str(workdir), str(out), *args],
        capture_output=True, text=True, timeout=240, env=env,
    )


def started(proc: subprocess.CompletedProcess[str]) -> tuple[int, int]:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STARTED "))
    epoch, step = line.split()[1:]
    return int(epoch), int(step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("reference")
    proc = run(f"file://{tmp / 'store'}", tmp, tmp / "final.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert started(proc) == (0, 0)
    return torch.load(tmp / "final.pt")


@pytest.mark.parametrize(
    ("mode", "kill_at", "resumed_at"),
    [("step", 8, (1, 6)), ("epoch", 12, (2, 10))],
    ids=["mid-epoch-saves", "epoch-end-saves"],
)
def test_killed_process_resumes_exactly(
    tmp_path: Path, reference: dict[str, torch.Tensor], mode: str, kill_at: int,
    resumed_at: tuple[int, int],
) -> None:
    store = f"file://{tmp_path / 'store'}"
    out = tmp_path / "final.pt"
    killed = run(store, tmp_path, out, "--mode", mode, "--kill-at", str(kill_at))
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert not out.exists()

    resumed = run(store, tmp_path, out, "--mode", mode)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert started(resumed) == resumed_at
    lib.assert_bitwise_equal(torch.load(out), reference)

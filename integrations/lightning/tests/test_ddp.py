"""DDP on CPU (two processes, gloo): only global rank zero mirrors; a killed run resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import taskpoint
import torch

SCRIPT = Path(__file__).with_name("train_script.py")


def run_ddp(*args: str) -> subprocess.CompletedProcess[str]:
    """A normal script run: Lightning starts the second rank itself."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--devices", "2", "--mode", "epoch"],
        capture_output=True, text=True, timeout=400, env=env,
    )


def uploads(log: Path) -> Counter[int]:
    """How many mirrors each global rank made."""
    return Counter(int(line.split()[1]) for line in log.read_text().splitlines())


@pytest.mark.slow
def test_ddp_only_rank_zero_uploads_and_a_killed_run_resumes(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    out = tmp_path / "final.pt"
    log = tmp_path / "uploads.log"
    # 20 samples over 2 ranks in batches of 4: 3 steps per epoch; mirrors after each epoch.
    killed = run_ddp(store, str(tmp_path), str(out), "--kill-at", "7", "--log", str(log))
    assert killed.returncode == 137, killed.stderr[-4000:]
    assert uploads(log) == Counter({0: 2})  # epochs 0 and 1, from rank 0 only

    resumed = run_ddp(store, str(tmp_path), str(out), "--log", str(log))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    line = next(x for x in resumed.stdout.splitlines() if x.startswith("STARTED "))
    assert line.split()[1:3] == ["2", "6"]
    assert uploads(log) == Counter({0: 5})  # then epochs 2, 3 and 4

    restored = taskpoint.Checkpoint(store).load_sync()
    assert restored is not None
    last = torch.load(restored / "last.ckpt", weights_only=True)
    assert last["global_step"] == 15
    assert len(last["taskpoint_rng"]["ranks"]) == 2  # each rank's random state
    assert torch.load(out)["net.0.weight"].isfinite().all()

"""A training process killed outright (os._exit(137)) resumes, in a new process, to the
same final weights as an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import taskpoint_lightning_testlib as lib
import torch

SCRIPT = Path(__file__).with_name("train_script.py")


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    """``train_script.py`` in a new Python process."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )


def started(proc: subprocess.CompletedProcess[str]) -> tuple[int, int]:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STARTED "))
    epoch, step = line.split()[1:3]
    return int(epoch), int(step)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning:lightning")
def test_killed_process_resumes_exactly(tmp_path: Path) -> None:
    L.seed_everything(0)
    model = lib.TinyModule()
    lib.trainer([], enable_checkpointing=False, default_root_dir=tmp_path).fit(
        model, lib.loader("resumable")
    )
    reference = lib.weights(model)

    store = f"file://{tmp_path / 'store'}"
    out = tmp_path / "final.pt"
    # Mirrors every 3 steps (5 batches per epoch); dies at step 8, inside epoch 1.
    killed = run_script(store, str(tmp_path), str(out), "--mode", "step", "--kill-at", "8")
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert not out.exists()

    resumed = run_script(store, str(tmp_path), str(out), "--mode", "step")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert started(resumed) == (1, 6)
    lib.assert_bitwise_equal(torch.load(out), reference)

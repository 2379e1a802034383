"""A training process killed at several points resumes bit for bit in a new process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import taskpoint
import torch

CHILD = Path(__file__).parent / "tp_torch_child.py"


def _run(url: str, out: Path, env: dict[str, str], *flags: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, str(CHILD), url, str(out), *flags],
        env=env, capture_output=True, text=True, timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_killed_processes_resume_to_the_uninterrupted_result(
    lib: ModuleType, tmp_path: Path, child_env: dict[str, str]
) -> None:
    url = f"file://{tmp_path / 'store'}"
    out = tmp_path / "final.pt"
    # Steps are 1-based, 4 per epoch, one save per epoch end (epochs 1..5).
    chain = [
        # os._exit(137) mid epoch 1: resumes at epoch 1 (one save committed).
        (("--die-at", "6"), -signal.SIGKILL, 137, "START 0 0"),
        # SIGKILL inside the 2nd save of this run (epoch 3's), before its upload.
        (("--kill-before-save", "2"), -signal.SIGKILL, None, "START 1 4"),
        # SIGKILL right after the 2nd commit of this run (epoch 4's).
        (("--kill-after-save", "2"), -signal.SIGKILL, None, "START 2 8"),
        # Finishes: resumes after epoch 4.
        ((), 0, None, "START 4 16"),
    ]
    for flags, killed, exited, start in chain:
        code, output = _run(url, out, child_env, *flags)
        expected = exited if exited is not None else killed
        assert code == expected, output
        assert start in output.splitlines(), output
    assert out.exists()
    result = torch.load(out, weights_only=True)
    reference = lib.run(lib.build())
    assert lib.bitwise_differences(result, reference) == []
    manifests = taskpoint.Checkpoint(url).committed()
    assert [m.attempt for m in manifests][:1] == [3], "the last run committed the final state"

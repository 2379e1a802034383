"""The examples run as documented, fail on purpose, and resume.

``pytorch_checkpoint.py``, the README's first command, runs in ``tests/test_docs.py``
(``first_screen_run``): its attempts, its result and its whole output, line for line
against the getting-started guide's sample, and its checkpoint folder.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[3] / "examples"


def _run(script: str, cwd: Path, env: dict[str, str]) -> str:
    env = {k: v for k, v in env.items() if k != "TASKPOINT_ROOT"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc.stdout


@pytest.mark.slow
def test_pytorch_ddp_example(tmp_path: Path, child_env: dict[str, str]) -> None:
    # PYTHONUNBUFFERED=1 (child_env) makes print() write a line and its newline separately;
    # the example writes each line at once, so both ranks' lines arrive whole.
    out = _run("pytorch_ddp.py", tmp_path, child_env)
    starts = re.findall(
        r"^\[rank (\d)/2, run (\d)\] starting at epoch (\d) \(step (\d+)\)$", out, re.MULTILINE
    )
    runs = {run for _, run, _, _ in starts}
    last = max(runs)
    assert sorted(s for s in starts if s[1] == "0") == [("0", "0", "0", "0"), ("1", "0", "0", "0")]
    # Rank 1 crashed in epoch 2 (16 steps per epoch per rank); the restarted group resumes
    # at epoch 2 on both ranks.
    assert sorted(s for s in starts if s[1] == last) == [("0", last, "2", "16"), ("1", last, "2", "16")]
    assert "ranks hold identical weights: True" in out
    assert (tmp_path / ".taskpoint" / "checkpoints" / "pytorch_ddp").is_dir()

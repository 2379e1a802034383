"""The deployment recipes of docs/preemption.md, run as written: the Kubernetes Job's and the
SLURM script's environment, the guide's ``train.py``, a real SIGTERM and a restart.

Only what cannot run here is replaced: the bucket (a local store), and the cluster (this
test starts each process as the platform would). The processes' steps are slowed by a
``sitecustomize`` module, so that the SIGTERM lands mid-run; the script itself is the
guide's, unchanged. A restart must resume at the step the SIGTERM stopped at, not at the
last periodic save.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from taskpoint import Checkpoint
from taskpoint.format.history import read_attempts
from taskpoint.store.store import Store

pytest.importorskip("taskpoint_pytorch")

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "preemption.md"
BUCKET = "s3://my-bucket/checkpoints"
SLOW_STEPS = textwrap.dedent(
    """
    import time
    import torch.optim

    _step = torch.optim.SGD.step

    def _slow_step(self, *args, **kwargs):
        time.sleep(0.05)   # a step of real training takes a while
        return _step(self, *args, **kwargs)

    torch.optim.SGD.step = _slow_step
    """
)


def _blocks(lang: str) -> list[str]:
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index("## Deployment notes"):]
    return re.findall(rf"^```{lang}\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)


def _train_script(tmp_path: Path) -> Path:
    (script,) = [b for b in _blocks("python") if "def main(" in b]
    path = tmp_path / "train.py"
    path.write_text(script)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_STEPS)
    return path


def _base_env(tmp_path: Path) -> dict[str, str]:
    prefixes = ("TASKPOINT_", "SLURM_", "TORCHELASTIC_", "SKYPILOT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.pop("RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return env


def _local(value: str, tmp_path: Path) -> str:
    return value.replace(BUCKET, f"file://{tmp_path / 'bucket'}")


def _life(command: list[str], cwd: Path, env: dict[str, str], term_after: int | None) -> tuple[
    int, str, str
]:
    """Run one process of the job; SIGTERM it once it printed step ``term_after`` (else
    SIGKILL it once it printed its start line). Returns its status, stdout and stderr."""
    child = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    lines = []
    try:
        for line in child.stdout:
            lines.append(line)
            if term_after is None and line.startswith("attempt "):
                child.kill()
                break
            if term_after is not None and line.strip() == f"step {term_after}":
                child.send_signal(signal.SIGTERM)
                break
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, "".join(lines) + out, err


def _start_step(stdout: str) -> tuple[int | None, int]:
    found = re.search(r"^attempt (\S+): starting at step (\d+)$", stdout, re.MULTILINE)
    assert found, stdout
    return (None if found[1] == "None" else int(found[1])), int(found[2])


def _check_resumed_at_the_signal(url: str, first: tuple[int, str, str], second_out: str) -> None:
    code, out, err = first
    assert code == 1 and "Preempted" in err, (code, out, err)
    records = read_attempts(Store(url))
    stopped = records[0]
    assert stopped.outcome == "preempted" and stopped.preemption_save == "committed", stopped
    assert stopped.step is not None and stopped.step >= 13  # not 10, the last periodic save
    attempt, start = _start_step(second_out)
    assert start == stopped.step, f"resumed at {start}, stopped at {stopped.step}"
    assert attempt == 1
    marked = [m.step for m in Checkpoint(url).committed() if m.preemption]
    assert marked == [stopped.step]


@pytest.mark.slow
def test_kubernetes_job_recipe_saves_on_sigterm_and_the_restart_resumes_there(
    tmp_path: Path,
) -> None:
    (manifest,) = [b for b in _blocks("yaml") if "kind: Job" in b]
    job = yaml.safe_load(manifest)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    script = _train_script(tmp_path)
    command = [sys.executable if c == "python" else c for c in container["command"]]
    env = _base_env(tmp_path)
    env.update({e["name"]: _local(e["value"], tmp_path) for e in container["env"]})
    assert "TASKPOINT_SAVE_ON_PREEMPTION" not in env, "the recipe as written sets no switch"

    first = _life(command, script.parent, env, term_after=13)
    assert _start_step(first[1]) == (0, 0)
    second = _life(command, script.parent, env, term_after=None)
    url = f"{env['TASKPOINT_ROOT']}/{env['TASKPOINT_ACTION']}/{env['TASKPOINT_RUN_ID']}"
    _check_resumed_at_the_signal(url, first, second[1])


@pytest.mark.slow
def test_slurm_recipe_saves_on_sigterm_and_the_requeued_job_resumes_there(
    tmp_path: Path,
) -> None:
    (batch,) = [b for b in _blocks("sh") if "#SBATCH" in b]
    script = _train_script(tmp_path)
    env = _base_env(tmp_path)
    for line in batch.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = _local(shlex.split(value)[0], tmp_path)
    (launch,) = [line for line in batch.splitlines() if line.startswith("srun ")]
    command = [sys.executable if c == "python" else c for c in shlex.split(launch)[1:]]
    env["SLURM_JOB_ID"] = "4242"

    first = _life(command, script.parent, {**env, "SLURM_RESTART_COUNT": "0"}, term_after=13)
    assert _start_step(first[1]) == (0, 0)
    second = _life(command, script.parent, {**env, "SLURM_RESTART_COUNT": "1"}, term_after=None)
    _check_resumed_at_the_signal(f"{env['TASKPOINT_ROOT']}/train/slurm-4242", first, second[1])

"""The environment contract: ctx().checkpoint in a plain script restarted by someone else."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from taskpoint.runtime.context import environment_context

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import taskpoint

    context = taskpoint.ctx()
    ckpt = context.checkpoint
    prev = ckpt.load_sync()
    start = int(prev.read_bytes()) if prev else 0
    print(f"start={start} attempt-env={context.attempt}", flush=True)
    for step in range(start, 10):
        if step == int(os.environ.get("DIE_AT", "-1")):
            os._exit(1)
        ckpt.save_sync(str(step + 1).encode())
    print(f"done action={context.action} attempt={ckpt.attempt}", flush=True)
    """
)


def _run(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TASKPOINT_", "SLURM_", "TORCHELASTIC_", "SKYPILOT_"))}
    return subprocess.run(
        [sys.executable, str(script)], cwd=script.parent, capture_output=True, text=True,
        env={**clean, **env},
    )


def test_plain_script_resumes_when_run_twice(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    env = {
        "TASKPOINT_ROOT": f"file://{tmp_path / 'store'}",
        "TASKPOINT_ACTION": "plain-train",
        "TASKPOINT_RUN_ID": "job-17",
    }
    first = _run(script, {**env, "DIE_AT": "4"})
    assert first.returncode == 1 and "start=0" in first.stdout
    second = _run(script, env)
    assert second.returncode == 0, second.stderr
    assert "start=4" in second.stdout
    assert "done action=plain-train/job-17 attempt=1" in second.stdout, "store numbered attempts"
    assert (tmp_path / "store" / "plain-train" / "job-17" / "attempts" / "000001").exists()


def test_explicit_attempt_variable(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    env = {"TASKPOINT_ROOT": str(tmp_path / "store"), "TASKPOINT_ACTION": "t",
           "TASKPOINT_ATTEMPT": "5"}
    result = _run(script, env)
    assert result.returncode == 0, result.stderr
    assert "attempt-env=5" in result.stdout and "done action=t/default attempt=5" in result.stdout


def test_torchelastic_restart_resumes_without_configuration(tmp_path: Path) -> None:
    script = tmp_path / "elastic_job.py"
    script.write_text(SCRIPT)
    base = {"TASKPOINT_ROOT": str(tmp_path / "store"), "TORCHELASTIC_RUN_ID": "abc123"}
    first = _run(script, {**base, "TORCHELASTIC_RESTART_COUNT": "0", "DIE_AT": "6"})
    assert first.returncode == 1
    second = _run(script, {**base, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert "start=6" in second.stdout
    assert "done action=elastic_job/torchelastic-abc123 attempt=1" in second.stdout


@pytest.mark.parametrize(
    ("env", "action", "attempt"),
    [
        ({"TORCHELASTIC_RUN_ID": "r9", "TORCHELASTIC_RESTART_COUNT": "2"}, "job/torchelastic-r9", 2),
        ({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "3"}, "job/slurm-4242", 3),
        ({"SLURM_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"}, "job/slurm-4242-7", 0),
        ({"SKYPILOT_TASK_ID": "sky-2026-11-29/train_1"}, "job/skypilot-sky-2026-11-29-train_1", None),
        ({"TASKPOINT_ACTION": "job"}, "job/default", None),
        ({"TASKPOINT_ACTION": "job", "TASKPOINT_RUN_ID": "x", "SLURM_JOB_ID": "1"}, "job/x", 0),
    ],
)
def test_orchestrators_are_recognised(
    env: dict[str, str], action: str, attempt: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["/srv/job.py"])
    context = environment_context({"TASKPOINT_ROOT": "memory://contract", **env})
    assert context is not None
    assert context.action == action
    assert context.attempt == attempt
    assert context.checkpoint is not None
    assert context.checkpoint.url == f"memory://contract/{action}"


def test_no_contract_means_no_context() -> None:
    assert environment_context({"HOME": "/root"}) is None
    assert environment_context({"TORCHELASTIC_RUN_ID": "none"}) is None


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="TASKPOINT_ATTEMPT"):
        environment_context({"TASKPOINT_ACTION": "a", "TASKPOINT_ATTEMPT": "two"})
    with pytest.raises(ValueError, match="TASKPOINT_ACTION"):
        environment_context({"TASKPOINT_ACTION": "../up"})

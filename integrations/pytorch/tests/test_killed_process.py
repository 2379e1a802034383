"""A training process killed at several points resumes bit for bit in a new process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
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


SAVER = textwrap.dedent(
    """
    import sys, time, torch, taskpoint
    from taskpoint_pytorch import TaskpointState

    def held(moved):  # an upload that never ends: a far, slow store
        print("uploading", flush=True)
        time.sleep(600)

    url, step = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    state = TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state.save_sync(taskpoint.Checkpoint(url, progress=held if step == 1 else None), step=step)
    """
)


def _ours(scratch: Path) -> list[Path]:
    return sorted(p for p in scratch.iterdir() if "taskpoint-" in p.name)


@pytest.mark.slow
def test_the_state_a_killed_save_serialised_goes_with_the_next_processs_save(
    tmp_path: Path,
) -> None:
    """A blocking save SIGKILLed while it uploads (the OOM killer, a node's reclaim) has
    its serialised state on the local disk: it stays there only until the next process on
    the machine saves, not until the disk fills with one state per kill."""
    url = f"file://{tmp_path / 'store'}"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    killed = subprocess.Popen(
        [sys.executable, "-c", SAVER, url, "1"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert killed.stdout is not None
        assert killed.stdout.readline().strip() == "uploading", killed.communicate()[0]
        serialised = [p for p in _ours(scratch) if any(p.rglob("state.pt"))]
        assert len(serialised) == 1, _ours(scratch)
    finally:
        killed.kill()
        killed.communicate(timeout=60)
    assert serialised[0].is_dir(), "a SIGKILL runs no clean-up: the state is left"

    later = subprocess.run(
        [sys.executable, "-c", SAVER, url, "2"], env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert later.returncode == 0, later.stderr
    assert _ours(scratch) == [], "the next save left its own or the killed one's state"
    committed = taskpoint.Checkpoint(url).committed()
    assert [m.step for m in committed] == [2]
    entries = committed[0].entries or []
    assert [e.path for e in entries if e.type != "dir"] == ["state.pt"], "only the bundle"

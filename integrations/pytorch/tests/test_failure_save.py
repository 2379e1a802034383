"""``TaskpointState(save_on_exception=True)``: an exception that ends the attempt saves the
state of the last save call, if nothing has changed it since, and the retry resumes there
bit for bit; a state that did change is not saved, and a warning says why.

Real processes under the environment contract (each life a new process, as a restarted pod
is) and a real ``@env.task`` retry; the loop saves every 5 steps and fails at step 8, whose
last save call (step 7) did not save.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import taskpoint
import torch
from taskpoint import TaskpointWarning
from taskpoint_pytorch import TaskpointState

LOOP = textwrap.dedent(
    """
    import hashlib, os, sys
    import torch, taskpoint
    from taskpoint_pytorch import TaskpointState

    FAIL_AT, WHERE = int(os.environ.get("FAIL_AT", "0")), os.environ.get("WHERE", "")

    def train(ckpt, fail_at):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 8)]
        if os.environ.get("BATCHNORM"):
            layers.append(torch.nn.BatchNorm1d(8))
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        state = TaskpointState(model, opt, sched, save_on_exception=True)
        resume = state.restore_sync(ckpt)
        start = resume.step if resume else 0
        print("START", start, flush=True)
        for step in range(start + 1, 13):
            x = torch.randn(16, 8)  # the step's batch, from the global RNG
            if step == fail_at and WHERE == "drawn":
                raise RuntimeError(f"failed at step {step}, its batch drawn")
            loss = model(x).pow(2).mean()
            if step == fail_at and WHERE == "forward":
                raise RuntimeError(f"failed at step {step}, after its forward pass")
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if step == fail_at and WHERE == "stepped":
                raise RuntimeError(f"failed at step {step}, after its optimizer step")
            state.save_sync(ckpt, step=step, every=5)
        digest = hashlib.sha256()
        for tensor in [*model.state_dict().values(), *opt.state_dict()["state"][0].values()]:
            digest.update(tensor.numpy().tobytes())
        digest.update(str(sched.state_dict()).encode())
        digest.update(torch.get_rng_state().numpy().tobytes())
        print("FINAL", digest.hexdigest(), flush=True)

    if os.environ.get("DECORATED"):
        env = taskpoint.TaskEnvironment(name="failures", root=os.environ["ROOT"])

        @env.task(retries=1)
        def job():
            context = taskpoint.ctx()
            train(context.checkpoint, FAIL_AT if context.attempt == 0 else 0)

        job()
    else:
        train(taskpoint.ctx().checkpoint, FAIL_AT)
    """
)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    prefixes = ("TASKPOINT_", "SLURM_", "TORCHELASTIC_", "SKYPILOT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.pop("RANK", None)
    return {**env, **extra}


def _life(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )


def _starts(result: subprocess.CompletedProcess[str]) -> list[int]:
    return [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("START")]


def _final(result: subprocess.CompletedProcess[str]) -> str:
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("FINAL")]
    return line.split()[1]


def _contract(tmp_path: Path, run: str, **extra: str) -> dict[str, str]:
    return _env(tmp_path, TASKPOINT_ROOT=f"file://{tmp_path / 'store'}",
                TASKPOINT_ACTION="train", TASKPOINT_RUN_ID=run, **extra)


@pytest.fixture
def reference(tmp_path: Path) -> str:
    """The final state of an uninterrupted run."""
    result = _life(tmp_path, _contract(tmp_path, "reference"))
    assert result.returncode == 0, result.stderr
    return _final(result)


def test_a_failure_after_the_batch_was_drawn_saves_the_last_call_and_resumes_exactly(
    tmp_path: Path, reference: str
) -> None:
    """The failing step drew its batch (the RNG moved) but changed no tensor: the save at
    the failure sets the RNG back to step 7's call, and the next life resumes at 7 and ends
    bit for bit where an uninterrupted run does."""
    failed = _life(tmp_path, _contract(tmp_path, "drawn", FAIL_AT="8", WHERE="drawn"))
    assert failed.returncode == 1 and "failed at step 8" in failed.stderr, failed.stderr
    assert "saved the state of step 7 at the failure (RuntimeError)" in failed.stderr
    steps = [m.step for m in taskpoint.Checkpoint(
        f"file://{tmp_path / 'store'}/train/drawn").committed()]
    assert steps[-1] == 7  # the newest commit
    resumed = _life(tmp_path, _contract(tmp_path, "drawn"))
    assert resumed.returncode == 0, resumed.stderr
    assert _starts(resumed) == [7]
    assert _final(resumed) == reference


@pytest.mark.parametrize(
    ("where", "batchnorm", "why"),
    [
        ("stepped", "", "since the save call at step 7, an optimizer stepped"),
        ("forward", "1", "since the save call at step 7, a tensor of the state was written in place"),
    ],
)
def test_a_state_changed_since_the_last_call_is_not_saved(
    tmp_path: Path, where: str, batchnorm: str, why: str
) -> None:
    """A failure after the optimizer step, or after a training-mode forward pass that
    updated BatchNorm's statistics: the state is no longer step 7's, so nothing is saved
    (saving it as step 7's would resume wrongly), the warning says why, and the next life
    resumes at the last save, 5, and still ends exactly."""
    extra = {"BATCHNORM": batchnorm} if batchnorm else {}
    reference = _life(tmp_path, _contract(tmp_path, f"ref-{where}", **extra))
    assert reference.returncode == 0, reference.stderr
    failed = _life(tmp_path, _contract(tmp_path, where, FAIL_AT="8", WHERE=where, **extra))
    assert failed.returncode == 1, failed.stderr
    assert f"no save at the failure (RuntimeError): {why}" in failed.stderr, failed.stderr
    resumed = _life(tmp_path, _contract(tmp_path, where, **extra))
    assert resumed.returncode == 0, resumed.stderr
    assert _starts(resumed) == [5]
    assert _final(resumed) == _final(reference)


def test_a_decorated_tasks_retry_resumes_at_the_failed_attempts_last_call(
    tmp_path: Path, reference: str
) -> None:
    """Inside ``@env.task(retries=1)``: the failed attempt saves step 7 at its failure, the
    retry in the same process resumes there and ends exactly."""
    result = _life(tmp_path, _env(tmp_path, DECORATED="1", ROOT=str(tmp_path / "tasks"),
                                  FAIL_AT="8", WHERE="drawn"))
    assert result.returncode == 0, result.stderr
    assert _starts(result) == [0, 7]
    assert "saved the state of step 7 at the failure" in result.stderr
    assert _final(result) == reference


def test_outside_a_task_or_the_contract_it_warns_that_it_cannot_save_at_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith(("TASKPOINT_", "SLURM_", "TORCHELASTIC_", "SKYPILOT_")):
            monkeypatch.delenv(name)
    model = torch.nn.Linear(2, 2)
    state = TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           save_on_exception=True)
    ckpt = taskpoint.Checkpoint(f"file://{tmp_path / 'store'}")
    with pytest.warns(TaskpointWarning, match="saves only inside a taskpoint task"):
        state.save_sync(ckpt, step=1, every=5)


def test_sharded_states_refuse_it() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="save_on_exception=True needs every rank to save"):
        TaskpointState(model, sharded=True, save_on_exception=True)


def test_the_optimizers_hook_does_not_keep_a_dropped_state_alive() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TaskpointState(model, opt, save_on_exception=True)
    dropped = weakref.ref(state)
    del state
    gc.collect()
    assert dropped() is None
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # its pre-hook finds the state gone


def test_a_parameter_replaced_since_the_last_call_is_a_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A parameter swapped for another tensor (not written in place, so no version counter
    moved) still counts as a change: nothing is saved at the failure."""
    env = taskpoint.TaskEnvironment(name="replaced", root=str(tmp_path / "store"))
    urls: list[str] = []

    @env.task
    def job() -> None:
        model = torch.nn.Linear(2, 2)
        state = TaskpointState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               save_on_exception=True)
        ckpt = taskpoint.ctx().checkpoint  # type: ignore[union-attr]
        urls.append(ckpt.url)
        state.save_sync(ckpt, step=1, every=5)
        model.weight = torch.nn.Parameter(torch.zeros(2, 2))
        raise RuntimeError("failed after the swap")

    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="after the swap"):
        job()
    assert "since the save call at step 1, the state's tensors are other tensors" in caplog.text
    assert taskpoint.Checkpoint(urls[0]).committed() == []  # step 1's call did not save

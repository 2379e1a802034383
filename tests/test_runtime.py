"""TaskEnvironment / @env.task: attempts, retries, context, roots and run ids."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import taskpoint

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _isolated_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TASKPOINT_ROOT", raising=False)
    monkeypatch.delenv("TASKPOINT_RUN_ID", raising=False)


@pytest.mark.parametrize("name", ["generic_checkpoint", "generic_checkpoint_sync"])
def test_generic_examples_fail_three_times_then_return_nine(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _load_example(name)
    result = module.count_up(10)
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    assert result == 9
    starts = [line for line in capsys.readouterr().out.splitlines() if "starting at" in line]
    assert starts == [
        "attempt 0: starting at iteration 0",
        "attempt 1: starting at iteration 3",
        "attempt 2: starting at iteration 6",
        "attempt 3: starting at iteration 9",
    ]
    assert (Path.cwd() / ".taskpoint" / "checkpoints").is_dir(), "embedded default store"


SPEC_ASYNC = '''
import taskpoint as flyte

env = flyte.TaskEnvironment(name="checkpoint_generic")

RETRIES = 3

@env.task(retries=RETRIES)
async def use_checkpoint(n_iterations: int = 10) -> int:
    checkpoint = flyte.ctx().checkpoint
    path = await checkpoint.load()
    start = int(path.read_bytes()) if path else 0
    failure_interval = n_iterations // RETRIES
    index = start
    for index in range(start, n_iterations):
        if index > start and index % failure_interval == 0:
            raise RuntimeError(f"Simulated failure at iteration {index}")
        await checkpoint.save(f"{index + 1}".encode())
    return index
'''


def test_spec_generic_example_runs_with_only_the_import_changed() -> None:
    namespace: dict[str, object] = {}
    exec(compile(SPEC_ASYNC, "spec_generic_checkpoint.py", "exec"), namespace)
    sync_source = (
        SPEC_ASYNC.replace("async def", "def")
        .replace("await checkpoint.load()", "checkpoint.load_sync()")
        .replace("await checkpoint.save(", "checkpoint.save_sync(")
        .replace('"checkpoint_generic"', '"checkpoint_generic_sync"')
    )
    sync_ns: dict[str, object] = {}
    exec(compile(sync_source, "spec_generic_checkpoint_sync.py", "exec"), sync_ns)
    assert asyncio.run(namespace["use_checkpoint"]()) == 9  # type: ignore[operator]
    assert sync_ns["use_checkpoint"]() == 9  # type: ignore[operator]


def test_context_inside_and_outside() -> None:
    assert taskpoint.ctx() is None
    env = taskpoint.TaskEnvironment(name="ctx", root="memory://ctx-test")
    seen: list[taskpoint.TaskContext] = []

    @env.task(retries=1, backoff=0)
    def task() -> str:
        context = taskpoint.ctx()
        assert context is not None
        seen.append(context)
        if context.attempt == 0:
            raise ValueError("first attempt fails")
        return "ok"

    assert task() == "ok"
    assert taskpoint.ctx() is None
    assert [c.attempt for c in seen] == [0, 1]
    assert seen[0].task == "ctx.task" and seen[0].run_id == seen[1].run_id
    assert seen[0].action == f"ctx.task/{seen[0].run_id}" and seen[0].retries == 1
    assert isinstance(seen[0].checkpoint, taskpoint.Checkpoint)
    assert seen[0].checkpoint.url == f"memory://ctx-test/ctx.task/{seen[0].run_id}"


def test_end_callbacks_run_after_each_attempt_before_its_outcome_is_recorded(
    tmp_path: Path,
) -> None:
    """What a plain loop's adapter relies on: the attempt's end, raised or returned, before
    the record and the retry; newest first, all of them; an error fails a good attempt."""
    from taskpoint.format.history import read_attempts
    from taskpoint.store.store import Store

    root = tmp_path / "store"
    env = taskpoint.TaskEnvironment(name="ends", root=str(root), run_id="r")
    calls: list[str] = []

    def ended_records() -> int:
        return sum(r.outcome is not None for r in read_attempts(Store(str(root / "ends.task/r"))))

    @env.task(retries=2, backoff=0)
    def task() -> str:
        context = taskpoint.ctx()
        assert context is not None
        attempt = context.attempt

        @context.on_end
        def first() -> None:
            calls.append(f"{attempt}:first:{ended_records()}")

        def failing() -> None:
            calls.append(f"{attempt}:failing")
            raise RuntimeError("an upload failed")

        context.on_end(failing if attempt == 1 else lambda: calls.append(f"{attempt}:second"))
        if attempt == 0:
            raise ValueError("first attempt fails")
        return "ok"

    assert task() == "ok"
    assert calls == [
        "0:second", "0:first:0",  # before attempt 0's record was written
        "1:failing", "1:first:1",  # the error fails attempt 1, which returned
        "2:second", "2:first:2",
    ]
    outcomes = [r.outcome for r in read_attempts(Store(str(root / "ends.task/r")))]
    assert outcomes == ["failed", "failed", "succeeded"]


FAILURES = """
import os, sys
from pathlib import Path
import taskpoint

LOG = Path(os.environ["CALLS"])  # the environment: a process attempt's child imports this
env = taskpoint.TaskEnvironment(name="failures", root=os.environ["ROOT"])


def note(attempt, text):
    with LOG.open("a") as fh:
        fh.write(f"{attempt}:{text}\\n")


def broken(exc):
    raise OSError("a callback failed")


@env.task(retries=2, backoff=0, isolation=os.environ["ISOLATION"])
def task():
    context = taskpoint.ctx()
    attempt = context.attempt

    def saw(exc):
        note(attempt, f"failure {type(exc).__name__}: {exc}")

    context.on_failure(broken)
    context.on_failure(saw)
    context.on_failure(saw)
    context.on_end(lambda: note(attempt, "end"))
    if attempt == 0:
        raise ValueError("a bad batch")
    if attempt == 1:
        raise taskpoint.Preempted("SIGTERM")
    return "ok"


if __name__ == "__main__":
    print(task())
"""


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_failure_callbacks_get_the_exception_before_the_end_callbacks(
    tmp_path: Path, isolation: str
) -> None:
    """What a save at the failure relies on: the attempt's exception, once, before the
    ``on_end`` callbacks; not for a preemption; one that raises is logged and the others
    still run; a callback registered twice runs once. In a process attempt, in the child."""
    script, log = tmp_path / "failures.py", tmp_path / "calls.txt"
    script.write_text(FAILURES)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={**os.environ, "CALLS": str(log), "ROOT": str(tmp_path / "store"),
                          "ISOLATION": isolation},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert log.read_text().splitlines() == [
        "0:failure ValueError: a bad batch", "0:end", "1:end", "2:end",
    ]
    assert "an on_failure callback failed" in result.stderr
    assert "OSError: a callback failed" in result.stderr


async def test_failure_callbacks_run_for_an_async_task() -> None:
    env = taskpoint.TaskEnvironment(name="async-failures", root="memory://async-failures")
    seen: list[str] = []

    @env.task(retries=1, backoff=0)
    async def task() -> str:
        context = taskpoint.ctx()
        assert context is not None
        context.on_failure(lambda exc: seen.append(f"{context.attempt}:{exc}"))
        if context.attempt == 0:
            raise RuntimeError("first")
        return "ok"

    assert await task() == "ok"
    assert seen == ["0:first"]


def test_checkpoints_disabled_gives_none() -> None:
    env = taskpoint.TaskEnvironment(name="nockpt", checkpoints=False)

    @env.task
    def task() -> object:
        context = taskpoint.ctx()
        assert context is not None
        return context.checkpoint

    assert task() is None


def test_last_exception_propagates_unchanged() -> None:
    env = taskpoint.TaskEnvironment(name="fails", root="memory://fails")
    raised: list[BaseException] = []

    @env.task(retries=2, backoff=0)
    def task() -> None:
        exc = KeyError(f"attempt {len(raised)}")
        raised.append(exc)
        raise exc

    with pytest.raises(KeyError) as info:
        task()
    assert len(raised) == 3
    assert info.value is raised[-1]


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_interrupts_are_never_retried(exc_type: type[BaseException]) -> None:
    env = taskpoint.TaskEnvironment(name="interrupt", root="memory://interrupt")
    calls: list[int] = []

    @env.task(retries=3, backoff=0)
    def task() -> None:
        calls.append(1)
        raise exc_type()

    with pytest.raises(exc_type):
        task()
    assert calls == [1]


async def test_async_task_is_awaited_and_retried() -> None:
    env = taskpoint.TaskEnvironment(name="async", root="memory://async-test")

    @env.task(retries=2, backoff=0)
    async def task(x: int) -> int:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        prev = await context.checkpoint.load()
        done = int(prev.read_bytes()) if prev else 0
        await context.checkpoint.save(str(done + 1).encode())
        if done < 2:
            raise RuntimeError("again")
        return x + done

    assert await task(10) == 12


def test_backoff_doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    delays: list[float] = []
    monkeypatch.setattr("taskpoint.runtime.tasks.time.sleep", delays.append)
    env = taskpoint.TaskEnvironment(name="backoff", root="memory://backoff")

    @env.task(retries=3, backoff=0.5)
    def task() -> None:
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        task()
    assert delays == [0.5, 1.0, 2.0]


def test_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = taskpoint.TaskEnvironment(name="roots")
    assert env.resolve_root() == str(Path.cwd() / ".taskpoint" / "checkpoints")
    monkeypatch.setenv("TASKPOINT_ROOT", "memory://from-env")
    assert env.resolve_root() == "memory://from-env"
    assert taskpoint.TaskEnvironment(name="r", root="memory://arg").resolve_root() == "memory://arg"


def test_run_id_reattaches_a_whole_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    env = taskpoint.TaskEnvironment(name="rerun", root="memory://rerun-test")
    starts: list[int] = []

    @env.task(retries=0)
    def task() -> int:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoint is not None
        prev = context.checkpoint.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        starts.append(start)
        for step in range(start, 6):
            context.checkpoint.save_sync(str(step + 1).encode())
            if step == 2 and start == 0:
                raise RuntimeError("whole run dies")
        return 6

    monkeypatch.setenv("TASKPOINT_RUN_ID", "nightly-7")
    with pytest.raises(RuntimeError):
        task()
    assert task() == 6
    assert starts == [0, 3]
    monkeypatch.delenv("TASKPOINT_RUN_ID")
    with pytest.raises(RuntimeError):
        task()
    assert starts[-1] == 0, "without the run id, a new run starts fresh"


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="TaskEnvironment name"):
        taskpoint.TaskEnvironment(name="bad/name")
    with pytest.raises(ValueError, match="run_id"):
        taskpoint.TaskEnvironment(name="ok", run_id="../escape")
    env = taskpoint.TaskEnvironment(name="ok")
    with pytest.raises(ValueError, match="retries"):
        env.task(retries=-1)
    with pytest.raises(ValueError, match="backoff"):
        env.task(backoff=-1.0)


def test_task_keeps_function_metadata() -> None:
    env = taskpoint.TaskEnvironment(name="meta", root="memory://meta")

    @env.task(retries=1)
    def documented(a: int) -> int:
        """Doc."""
        return a

    assert documented.__name__ == "documented" and documented.__doc__ == "Doc."
    assert documented(3) == 3


def test_example_script_prints_attempt_starts(tmp_path: Path) -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "generic_checkpoint_sync.py")],
        cwd=tmp_path, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout
    assert "attempt 3: starting at iteration 9" in out and "result: 9" in out

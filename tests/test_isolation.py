"""Process-isolated attempts: crashes, signals and segfaults are retried attempts."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import taskpoint

    env = taskpoint.TaskEnvironment(name="iso", root=os.environ["STORE"], run_id="r1")
    PIDFILE = Path(os.environ["PIDFILE"])

    def step_value(value: int, step: int) -> int:
        return (value * 31 + step * step + 7) % 1_000_000_007

    @env.task(retries=int(os.environ.get("RETRIES", "40")), backoff=0.0, isolation="process")
    def train(steps: int) -> dict:
        PIDFILE.write_text(str(os.getpid()))
        ckpt = taskpoint.ctx().checkpoint
        prev = ckpt.load_sync()
        state = json.loads(prev.read_bytes()) if prev else {"step": 0, "value": 1}
        crash = os.environ.get("CRASH", "")
        attempt = taskpoint.ctx().attempt
        while state["step"] < steps:
            if attempt == 0 and crash == "exit" and state["step"] == 3:
                os._exit(137)
            if attempt == 1 and crash == "exit" and state["step"] == 6:
                import ctypes
                ctypes.string_at(0)  # segfault
            state = {"step": state["step"] + 1, "value": step_value(state["value"], state["step"])}
            time.sleep(float(os.environ.get("STEP_SECONDS", "0")))
            ckpt.save_sync(json.dumps(state).encode())
        return {"value": state["value"], "attempt": attempt}

    if __name__ == "__main__":
        print(json.dumps(train(int(sys.argv[1]))), flush=True)
    """
)


def _expected(steps: int) -> int:
    value = 1
    for step in range(steps):
        value = (value * 31 + step * step + 7) % 1_000_000_007
    return value


def _start(tmp_path: Path, steps: int, **env: str) -> subprocess.Popen[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return subprocess.Popen(
        [sys.executable, str(script), str(steps)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "STORE": f"file://{tmp_path / 'store'}",
            "PIDFILE": str(tmp_path / "pid"),
            **env,
        },
    )


def test_exit_code_and_segfault_are_retried(tmp_path: Path) -> None:
    proc = _start(tmp_path, 10, CRASH="exit")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert '"attempt": 2' in out and f'"value": {_expected(10)}' in out
    assert "exited with code 137" in err
    assert "killed by SIGSEGV" in err


def test_sigkill_at_random_points_many_times_still_finishes_right(tmp_path: Path) -> None:
    steps = 60
    proc = _start(tmp_path, steps, STEP_SECONDS="0.05")  # 3 s of work in all
    rng = random.Random(7)
    pidfile = tmp_path / "pid"
    killed: set[int] = set()
    deadline = time.monotonic() + 150
    while len(killed) < 8 and proc.poll() is None and time.monotonic() < deadline:
        try:
            pid = int(pidfile.read_text())
        except (FileNotFoundError, ValueError):
            pid = 0
        if pid == 0 or pid in killed:
            time.sleep(0.01)  # wait for the next attempt's child to start working
            continue
        time.sleep(rng.uniform(0.05, 0.4))  # at most 8 steps, mid-step or mid-save
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert len(killed) >= 5, f"only {len(killed)} kills landed before the run finished"
    assert err.count("killed by SIGKILL") >= 5
    assert f'"value": {_expected(steps)}' in out


SIGTERM_TASK = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import taskpoint

    env = taskpoint.TaskEnvironment(name="preempt", root=os.environ["STORE"], run_id="r1")

    @env.task(retries=2, backoff=0.0, isolation="process")
    def train() -> dict:
        context = taskpoint.ctx()
        prev = context.checkpoint.load_sync()
        step = int(prev.read_bytes()) if prev else 0
        start = step
        state = {"step": step}

        @context.on_preempt
        def save_now() -> None:
            context.checkpoint.save_sync(str(state["step"]).encode())
            Path(os.environ["HOOKFILE"]).write_text(str(state["step"]))

        Path(os.environ["PIDFILE"]).write_text(str(os.getpid()))
        while state["step"] < start + 1000 and (context.attempt == 0 or state["step"] < start + 5):
            time.sleep(0.01)
            state["step"] += 1
        return {"start": start, "attempt": context.attempt}

    if __name__ == "__main__":
        print(json.dumps(train()), flush=True)
    """
)


def test_sigterm_runs_the_preempt_hook_then_retries(tmp_path: Path) -> None:
    script = tmp_path / "preempt.py"
    script.write_text(SIGTERM_TASK)
    pidfile, hookfile = tmp_path / "pid", tmp_path / "hook"
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "STORE": f"file://{tmp_path / 'store'}", "PIDFILE": str(pidfile),
             "HOOKFILE": str(hookfile)},
    )
    deadline = time.monotonic() + 60
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    os.kill(int(pidfile.read_text()), signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    saved = int(hookfile.read_text())
    assert saved > 0
    assert f'"start": {saved}' in out and '"attempt": 1' in out
    assert "Preempted" in err


def test_unpicklable_arguments_are_refused_clearly(tmp_path: Path) -> None:
    script = tmp_path / "bad_args.py"
    script.write_text(textwrap.dedent(
        """
        import taskpoint
        env = taskpoint.TaskEnvironment(name="bad", root="memory://bad")

        @env.task(retries=2, isolation="process")
        def task(x) -> int:
            return 1

        if __name__ == "__main__":
            try:
                task(lambda: 1)
            except TypeError as exc:
                print("TypeError:", exc)
        """
    ))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout
    assert "must be picklable" in out


def test_child_exception_propagates_with_its_traceback(tmp_path: Path) -> None:
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(
        """
        import taskpoint
        env = taskpoint.TaskEnvironment(name="raises", root="memory://raises")

        @env.task(retries=1, backoff=0, isolation="process")
        def task() -> int:
            raise KeyError("in the child")

        if __name__ == "__main__":
            try:
                task()
            except KeyError as exc:
                print("caught", repr(exc))
                print("".join(getattr(exc, "__notes__", [])))
        """
    ))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout
    assert "caught KeyError('in the child')" in out
    assert 'raise KeyError("in the child")' in out


@pytest.mark.parametrize("isolation", ["process"])
def test_process_isolation_returns_the_value(tmp_path: Path, isolation: str) -> None:
    script = tmp_path / "ok.py"
    script.write_text(textwrap.dedent(
        f"""
        import taskpoint
        env = taskpoint.TaskEnvironment(name="ok", root="file://{tmp_path}/store")

        @env.task(isolation="{isolation}")
        async def task(a: int, *, b: int) -> dict:
            return {{"sum": a + b, "pid_differs": True}}

        if __name__ == "__main__":
            import asyncio
            print(asyncio.run(task(2, b=3)))
        """
    ))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout
    assert "'sum': 5" in out


PIDS_TASK = textwrap.dedent(
    """
    import json, os, sys
    import taskpoint

    env = taskpoint.TaskEnvironment(name="pids", root=os.environ["STORE"], run_id="r1")

    @env.task(retries=1, backoff=0.0, isolation="process")
    def work() -> int:
        context = taskpoint.ctx()
        print(json.dumps({"attempt": context.attempt, "pid": os.getpid()}), flush=True)
        if context.attempt == 0:
            os._exit(3)
        return os.getpid()

    if __name__ == "__main__":
        work()
        print(json.dumps({"runner": os.getpid()}), flush=True)
    """
)


def test_each_attempts_record_names_the_process_it_ran_in(tmp_path: Path) -> None:
    import json

    from taskpoint.format.history import read_attempts
    from taskpoint.store.store import Store

    script = tmp_path / "pids.py"
    script.write_text(PIDS_TASK)
    store = f"file://{tmp_path / 'store'}"
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "STORE": store}, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    runner = next(line["runner"] for line in lines if "runner" in line)
    ran_in = {line["attempt"]: line["pid"] for line in lines if "attempt" in line}
    records = {r.attempt: r for r in read_attempts(Store(f"{store}/pids.work/r1"))}
    assert sorted(records) == [0, 1]
    for attempt, pid in ran_in.items():
        assert pid != runner
        assert records[attempt].pid == pid, (
            f"attempt {attempt} ran in pid {pid}; its record says {records[attempt].pid} "
            f"(the runner is {runner})"
        )
    assert records[0].outcome == "crashed" and records[1].outcome == "succeeded"

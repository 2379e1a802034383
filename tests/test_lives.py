"""A run an orchestrator restarts: every process is one attempt (one life) of the run.

Real processes, really killed: a fixed run id under ``@env.task`` and the environment
contract without a decorator. Each life claims the next attempt number from the store, its
end is recorded where the process can (success, exception, SIGTERM) and by the next life
where it could not (SIGKILL), and ``taskpoint show`` lists every life.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from taskpoint.cli import main
from taskpoint.format.history import read_attempts
from taskpoint.store.store import Store

DECORATED = textwrap.dedent(
    """
    import os, signal
    import taskpoint

    env = taskpoint.TaskEnvironment(name="lives", run_id="job-1")

    @env.task
    def train(steps: int = 12) -> int:
        context = taskpoint.ctx()
        ckpt = context.checkpoint
        prev = ckpt.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        print(f"life attempt={context.attempt} start={start}", flush=True)
        for step in range(start, steps):
            if step == int(os.environ.get("KILL_AT", "-1")):
                os.kill(os.getpid(), signal.SIGKILL)
            taskpoint.report_step(step + 1)
            ckpt.save_sync(str(step + 1).encode())
        return steps

    print("result", train(), flush=True)
    """
)

PLAIN = textwrap.dedent(
    """
    import os, signal, time
    import taskpoint

    context = taskpoint.ctx()
    ckpt = context.checkpoint
    prev = ckpt.load_sync()
    start = int(prev.read_bytes()) if prev else 0
    print(f"life attempt={context.attempt} start={start}", flush=True)
    how, at = os.environ.get("FAIL", "none:-1").split(":")
    for step in range(start, 12):
        if step == int(at):
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "raise":
                raise RuntimeError(f"simulated failure at step {step}")
            if how == "term":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        taskpoint.report_step(step + 1)
        ckpt.save_sync(str(step + 1).encode())
    print("done", flush=True)
    """
)

BOUNDARY = textwrap.dedent(
    """
    import os, signal
    import taskpoint
    from taskpoint.runtime.step_boundary import StepBoundary

    context = taskpoint.ctx()
    ckpt = context.checkpoint
    prev = ckpt.load_sync()
    start = int(prev.read_bytes()) if prev else 0
    print(f"life attempt={context.attempt} start={start}", flush=True)
    boundary = StepBoundary()
    boundary.begin()
    for step in range(start, 12):
        if step == int(os.environ.get("TERM_AT", "-1")):
            os.kill(os.getpid(), signal.SIGTERM)   # only noted: the boundary saves
        if boundary.reached(step + 1):
            if os.environ.get("KILL_IN_SAVE"):
                os.kill(os.getpid(), signal.SIGKILL)   # the grace period ends mid-save
            ckpt.save_sync(str(step + 1).encode())
            boundary.stop(step + 1, saved=True, checkpoint=ckpt)
        if (step + 1) % 5 == 0:
            ckpt.save_sync(str(step + 1).encode())
    print("done", flush=True)
    """
)


def _clean_env() -> dict[str, str]:
    prefixes = ("TASKPOINT_", "SLURM_", "TORCHELASTIC_", "SKYPILOT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.pop("RANK", None)
    return env


def _life(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)], cwd=script.parent, capture_output=True, text=True,
        env={**_clean_env(), **env}, timeout=120,
    )


def _attempt_seen(result: subprocess.CompletedProcess[str]) -> tuple[int, int]:
    found = re.search(r"life attempt=(\d+) start=(\d+)", result.stdout)
    assert found, (result.stdout, result.stderr)
    return int(found[1]), int(found[2])


def _show(root: Path, action: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        main, ["show", action, "--root", str(root), "--no-verify", *args],
        env={"COLUMNS": "200"},
    )
    return result.exit_code, result.output


def test_three_lives_of_a_decorated_task_are_three_attempts(tmp_path: Path) -> None:
    """Two processes SIGKILLed mid-run, the third succeeds: the attempts are 0, 1, 2 in
    them, and `taskpoint show` lists three, two died and one succeeded."""
    script = tmp_path / "job.py"
    script.write_text(DECORATED)
    root = tmp_path / "store"
    env = {"TASKPOINT_ROOT": str(root)}
    lives = [_life(script, {**env, "KILL_AT": "4"}), _life(script, {**env, "KILL_AT": "8"}),
             _life(script, env)]
    assert [r.returncode for r in lives] == [-signal.SIGKILL, -signal.SIGKILL, 0], lives[2].stderr
    assert [_attempt_seen(r) for r in lives] == [(0, 0), (1, 4), (2, 8)]

    code, out = _show(root, "lives.train/job-1", "--json")
    assert code == 0, out
    detail = json.loads(out)["attempts_detail"]
    assert [(a["attempt"], a["state"]) for a in detail] == [
        (0, "died"), (1, "died"), (2, "succeeded")
    ]
    assert [a["noted_by"] for a in detail] == [1, 2, None]
    assert [a["resumed_step"] for a in detail] == [None, 4, 8]
    code, text = _show(root, "lives.train/job-1")
    assert code == 0 and "3 attempts" in text, text
    assert text.count("died") >= 2 and "saved up to step 8: the steps after it were lost" in text, text


def test_a_retry_in_a_restarted_process_counts_on(tmp_path: Path) -> None:
    """A restarted life's retries take the numbers after its own claim."""
    script = tmp_path / "retry.py"
    script.write_text(textwrap.dedent(
        """
        import taskpoint
        env = taskpoint.TaskEnvironment(name="lives", run_id="job-2")
        seen = []

        @env.task(retries=1, backoff=0)
        def flaky() -> None:
            seen.append(taskpoint.ctx().attempt)
            if len(seen) == 1:
                raise RuntimeError("once")

        flaky()
        print("seen", seen, flush=True)
        """
    ))
    env = {"TASKPOINT_ROOT": str(tmp_path / "store")}
    first, second = _life(script, env), _life(script, env)
    assert "seen [0, 1]" in first.stdout, first.stderr
    assert "seen [2, 3]" in second.stdout, second.stderr
    records = read_attempts(Store(str(tmp_path / "store" / "lives.flaky" / "job-2")))
    assert [r.outcome for r in records] == ["failed", "succeeded", "failed", "succeeded"]


def test_environment_contract_lives_record_their_ends(tmp_path: Path) -> None:
    """Without a decorator: a SIGKILL (recorded by the next life), an exception (with its
    traceback), a SIGTERM that nothing handles, and a success each leave an end record."""
    script = tmp_path / "train.py"
    script.write_text(PLAIN)
    env = {"TASKPOINT_ROOT": f"file://{tmp_path / 'store'}", "TASKPOINT_ACTION": "train",
           "TASKPOINT_RUN_ID": "job-3"}
    lives = [_life(script, {**env, "FAIL": fail}) for fail in ("kill:3", "raise:6", "term:9")]
    lives.append(_life(script, env))
    assert [r.returncode for r in lives] == [-signal.SIGKILL, 1, -signal.SIGTERM, 0], [
        r.stderr for r in lives
    ]
    assert [_attempt_seen(r) for r in lives] == [(0, 0), (1, 3), (2, 6), (3, 9)]
    records = read_attempts(Store(str(tmp_path / "store" / "train" / "job-3")))
    assert [(r.attempt, r.outcome, r.noted_by) for r in records] == [
        (0, "crashed", 1), (1, "failed", None), (2, "preempted", None), (3, "succeeded", None)
    ]
    died, failed, preempted, succeeded = records
    assert died.died and died.ended is None
    assert failed.step == 6 and failed.error == "RuntimeError: simulated failure at step 6"
    assert failed.traceback is not None and failed.traceback.startswith("Traceback")
    assert 'train.py", line' in failed.traceback
    assert preempted.step == 9 and preempted.ended is not None
    assert succeeded.step == 12 and succeeded.traceback is None

    code, text = _show(tmp_path / "store", "train/job-3")
    assert code == 0 and "4 attempts" in text, text
    assert "traceback kept: show --verbose" in text and "Traceback" not in text
    code, verbose = _show(tmp_path / "store", "train/job-3", "--verbose")
    assert code == 0 and "Traceback (most recent call last)" in verbose, verbose
    assert "raise RuntimeError" in verbose


def test_environment_contract_lives_on_an_object_store_record_their_ends(
    tmp_path: Path, seaweed_server: Any
) -> None:
    """On S3 (SeaweedFS) too: a normal exit's end record is written while the S3 client
    can still open a connection (a plain ``atexit`` hook comes after the interpreter's
    thread pools shut down, where the client resolves addresses, and the record was lost:
    the life read as died); an exception's and a SIGTERM's as well."""
    script = tmp_path / "train.py"
    script.write_text(PLAIN)
    url = seaweed_server.url("taskpoint-tests", f"lives-{uuid.uuid4().hex}")
    env = {"TASKPOINT_ROOT": url, "TASKPOINT_ACTION": "train", "TASKPOINT_RUN_ID": "job-5"}
    lives = [_life(script, {**env, "FAIL": fail}) for fail in ("raise:3", "term:6")]
    lives.append(_life(script, env))
    assert [r.returncode for r in lives] == [1, -signal.SIGTERM, 0], [r.stderr for r in lives]
    assert [_attempt_seen(r) for r in lives] == [(0, 0), (1, 3), (2, 6)]
    for life in lives:
        assert "could not write" not in life.stderr, life.stderr
    records = read_attempts(Store(f"{url}/train/job-5"))
    assert [(r.outcome, r.step, r.noted_by) for r in records] == [
        ("failed", 3, None), ("preempted", 6, None), ("succeeded", 12, None)
    ]


def test_a_life_that_ends_with_os_exit_after_the_atexit_handlers_records_its_end(
    tmp_path: Path,
) -> None:
    """A script that ends with ``atexit._run_exitfuncs()`` and ``os._exit(0)`` (as scripts do
    to skip a framework's teardown at finalisation) never runs threading's exit hooks,
    where the end record is written; the plain ``atexit`` hook writes it then."""
    script = tmp_path / "train.py"
    script.write_text(PLAIN + "import atexit\natexit._run_exitfuncs()\nos._exit(0)\n")
    env = {"TASKPOINT_ROOT": f"file://{tmp_path / 'store'}", "TASKPOINT_ACTION": "train",
           "TASKPOINT_RUN_ID": "job-6"}
    life = _life(script, env)
    assert life.returncode == 0 and "done" in life.stdout, life.stderr
    records = read_attempts(Store(str(tmp_path / "store" / "train" / "job-6")))
    assert [(r.outcome, r.step) for r in records] == [("succeeded", 12)]


FORKS = textwrap.dedent(
    """
    import multiprocessing, os, sys
    import taskpoint
    from taskpoint.format.history import read_attempts
    from taskpoint.store.store import Store

    def work():
        pass  # a data loader's worker, say: it ends while its parent trains on

    context = taskpoint.ctx()
    context.checkpoint.save_sync(b"1")
    child = multiprocessing.get_context("fork").Process(target=work)
    child.start()
    child.join()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a plain fork's child that exits normally, running the exit hooks
    os.waitpid(pid, 0)
    outcomes = [r.outcome for r in read_attempts(Store(os.environ["RECORDS"]))]
    print("after the children:", outcomes, flush=True)
    """
)


def test_a_forked_child_ending_records_nothing_for_its_parents_life(tmp_path: Path) -> None:
    """A multiprocessing worker (which runs threading's exit hooks) and a plain fork's child
    (which runs the atexit hooks too) inherit the parent's life; their ends are not the
    life's end. Only the parent's exit records it."""
    script = tmp_path / "forks.py"
    script.write_text(FORKS)
    store = tmp_path / "store"
    records = str(store / "train" / "job-7")
    env = {"TASKPOINT_ROOT": f"file://{store}", "TASKPOINT_ACTION": "train",
           "TASKPOINT_RUN_ID": "job-7", "RECORDS": records}
    life = _life(script, env)
    assert life.returncode == 0, life.stderr
    assert "after the children: [None]" in life.stdout, (life.stdout, life.stderr)
    assert [r.outcome for r in read_attempts(Store(records))] == ["succeeded"]


def test_a_kill_in_the_preemption_save_finds_the_end_recorded(tmp_path: Path) -> None:
    """Under the environment contract the step boundary saves on SIGTERM by default, and
    records the life as preempted before it saves: a SIGKILL at the grace period's end,
    landing in the save, leaves `preempted`, not a life that died without a record."""
    script = tmp_path / "loop.py"
    script.write_text(BOUNDARY)
    env = {"TASKPOINT_ROOT": str(tmp_path / "store"), "TASKPOINT_ACTION": "loop",
           "TASKPOINT_RUN_ID": "job-4", "TASKPOINT_GRACE_PERIOD": "30"}
    killed = _life(script, {**env, "TERM_AT": "7", "KILL_IN_SAVE": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    stopped = _life(script, {**env, "TERM_AT": "8"})
    assert stopped.returncode == 1 and "Preempted" in stopped.stderr, stopped.stderr
    last = _life(script, env)
    assert last.returncode == 0, last.stderr
    assert [_attempt_seen(r) for r in (killed, stopped, last)] == [(0, 0), (1, 5), (2, 9)]
    records = read_attempts(Store(str(tmp_path / "store" / "loop" / "job-4")))
    assert [(r.outcome, r.step, r.preemption_save) for r in records] == [
        ("preempted", 8, "missed"), ("preempted", 9, "committed"), ("succeeded", 12, None)
    ]


def test_a_traceback_is_kept_to_a_bounded_size(tmp_path: Path) -> None:
    from taskpoint.format.history import TRACEBACK_CHARS, record_end, trim_traceback

    store = Store(str(tmp_path / "store"))
    long = "Traceback (most recent call last):\n" + "  frame\n" * 10_000 + "ValueError: end"
    record_end(store, 0, "failed", "ValueError: end", traceback=long)
    (record,) = read_attempts(store)
    assert record.traceback is not None and len(record.traceback) <= TRACEBACK_CHARS
    assert record.traceback.startswith("Traceback") and record.traceback.endswith("ValueError: end")
    assert "characters left out" in record.traceback
    assert trim_traceback("short") == "short"


def test_an_attempt_of_a_process_still_running_here_is_not_called_died(tmp_path: Path) -> None:
    """Two writers of one action in this process: the second's claim leaves the first's
    attempt unended (its process lives); a dead process's attempt is recorded as died."""
    from taskpoint import Checkpoint

    url = str(tmp_path / "store")
    first, second = Checkpoint(url), Checkpoint(url)
    first.mark_started()
    dead = subprocess.run(
        [sys.executable, "-c", "import sys, taskpoint; c = taskpoint.Checkpoint(sys.argv[1]); "
         "c.mark_started(); print(c.attempt)", url],
        capture_output=True, text=True, check=True,
    )
    assert (first.attempt, int(dead.stdout)) == (0, 1)
    second.mark_started()
    assert second.attempt == 2
    records = read_attempts(Store(url))
    assert [(r.attempt, r.outcome, r.noted_by) for r in records] == [
        (0, None, None), (1, "crashed", 2), (2, None, None)
    ]


def test_the_ranks_of_a_restarted_job_share_the_leading_ranks_attempt(tmp_path: Path) -> None:
    """Two ranks of a job (RANK 0 and 1) run the same decorated task, twice: the leading
    rank claims each life's attempt and the other follows it, so both see 0, then 1, and
    the history holds two attempts, not four."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(
        """
        import os, time
        import taskpoint
        env = taskpoint.TaskEnvironment(name="lives", run_id="job-5")

        @env.task
        def train() -> int | None:
            if os.environ["RANK"] == "1":
                time.sleep(0.5)   # the other rank may start first or last
            return taskpoint.ctx().attempt

        print("attempt", train(), flush=True)
        """
    ))
    base = {**_clean_env(), "TASKPOINT_ROOT": str(tmp_path / "store")}
    for life in (0, 1):
        ranks = [
            subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**base, "RANK": rank})
            for rank in ("1", "0")
        ]
        outs = [rank.communicate(timeout=120) for rank in ranks]
        assert [o for o, _ in outs] == [f"attempt {life}\n"] * 2, outs
    records = read_attempts(Store(str(tmp_path / "store" / "lives.train" / "job-5")))
    assert [(r.attempt, r.outcome) for r in records] == [(0, "succeeded"), (1, "succeeded")]

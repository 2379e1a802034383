"""Preemption notices: real SIGTERMs, in processes of their own (handlers are per process).

Each script prints one JSON line of what it saw; the assertions are here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _run(tmp_path: Path, body: str, **env: str) -> dict[str, Any]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "STORE": f"file://{tmp_path / 'store'}", **env}, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    return json.loads(line)  # type: ignore[no-any-return]


def test_a_handler_installed_before_taskpoints_still_runs(tmp_path: Path) -> None:
    seen = _run(tmp_path, """
        import json, os, signal
        from taskpoint import preemption

        ran = []
        signal.signal(signal.SIGTERM, lambda signum, frame: ran.append("framework"))
        preemption.install()
        with preemption.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            requested = preemption.requested()
        print(json.dumps({"ran": ran, "requested": requested,
                          "signal": preemption.notice().signal}))
    """)
    assert seen == {"ran": ["framework"], "requested": True, "signal": "SIGTERM"}


def test_installing_again_takes_the_top_back_from_a_handler_that_does_not_compose(
    tmp_path: Path,
) -> None:
    """transformers' JIT checkpointing installs a handler that calls nobody before it."""
    seen = _run(tmp_path, """
        import json, os, signal
        from taskpoint import preemption

        ran = []
        preemption.install()
        signal.signal(signal.SIGTERM, lambda signum, frame: ran.append("library"))
        with preemption.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            hidden = preemption.requested()
            preemption.install()
            os.kill(os.getpid(), signal.SIGTERM)
            requested = preemption.requested()
        print(json.dumps({"ran": ran, "hidden": hidden, "requested": requested}))
    """)
    # The replaced handler hid the first signal; on top again, taskpoint sees the second
    # and still runs the library's handler.
    assert seen == {"ran": ["library", "library"], "hidden": False, "requested": True}


def test_a_handler_that_composes_with_taskpoints_runs_once_each(tmp_path: Path) -> None:
    """Lightning composes with the handler it replaces; installing ours on top of that
    must not loop."""
    seen = _run(tmp_path, """
        import json, os, signal
        from taskpoint import preemption

        ran = []
        preemption.install()
        before = signal.getsignal(signal.SIGTERM)

        def composing(signum, frame):
            ran.append("framework")
            before(signum, frame)

        signal.signal(signal.SIGTERM, composing)
        preemption.install()
        with preemption.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
        print(json.dumps({"ran": ran, "requested": preemption.requested()}))
    """)
    assert seen == {"ran": ["framework"], "requested": True}


def test_the_notice_carries_the_grace_period_as_its_deadline(tmp_path: Path) -> None:
    seen = _run(tmp_path, """
        import json, os, signal, time
        from taskpoint import preemption

        preemption.install()
        with preemption.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
        notice = preemption.notice()
        print(json.dumps({"remaining": notice.remaining(), "age": time.time() - notice.received}))
    """, TASKPOINT_GRACE_PERIOD="7.5")
    assert 0 <= seen["age"] < 5
    assert 7.5 - 5 < seen["remaining"] <= 7.5


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_a_grace_period_that_is_not_seconds_is_refused_clearly(value: str) -> None:
    from taskpoint import preemption

    with pytest.raises(ValueError, match=r"TASKPOINT_GRACE_PERIOD must be a number of seconds"):
        preemption.grace_period({"TASKPOINT_GRACE_PERIOD": value})
    assert preemption.grace_period({}) == preemption.DEFAULT_GRACE_S == 30.0
    assert preemption.grace_period({"TASKPOINT_GRACE_PERIOD": "120"}) == 120.0


TASK = """
    import json, os, signal
    import taskpoint
    from taskpoint import preemption
    from taskpoint.format.history import read_attempts
    from taskpoint.store.store import Store

    env = taskpoint.TaskEnvironment(name="spot", root=os.environ["STORE"], run_id="r1")

    @env.task(retries=1, backoff=0.0, isolation=os.environ["ISOLATION"])
    def train() -> str:
        context = taskpoint.ctx()
        if context.attempt == 0:
            # A framework that saves at the next step boundary and returns early.
            with preemption.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
            return "stopped early at step 3"
        return "finished"

    if __name__ == "__main__":
        result = train()
        records = read_attempts(Store(os.environ["STORE"] + "/spot.train/r1"))
        print(json.dumps({"result": result, "outcomes": [r.outcome for r in records],
                          "errors": [r.error for r in records]}))
"""


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_an_attempt_that_returns_after_sigterm_is_preempted_never_succeeded(
    tmp_path: Path, isolation: str
) -> None:
    seen = _run(tmp_path, TASK, ISOLATION=isolation)
    assert seen["result"] == "finished", "the early return was taken as the task's result"
    assert seen["outcomes"] == ["preempted", "succeeded"]
    assert "received SIGTERM and returned after it" in seen["errors"][0]


def test_save_on_preemption_is_the_argument_then_the_variable_then_being_in_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from taskpoint import preemption

    monkeypatch.delenv(preemption.ENV_SAVE, raising=False)
    assert preemption.save_on_preemption(None, in_task=True) is True
    assert preemption.save_on_preemption(None, in_task=False) is False
    assert preemption.save_on_preemption(False, in_task=True) is False
    monkeypatch.setenv(preemption.ENV_SAVE, "1")
    assert preemption.save_on_preemption(None, in_task=False) is True
    monkeypatch.setenv(preemption.ENV_SAVE, "off")
    assert preemption.save_on_preemption(None, in_task=True) is False
    assert preemption.save_on_preemption(True, in_task=False) is True
    monkeypatch.setenv(preemption.ENV_SAVE, "maybe")
    with pytest.raises(ValueError, match="TASKPOINT_SAVE_ON_PREEMPTION must be"):
        preemption.save_on_preemption(None, in_task=True)


def test_a_rank_told_by_another_notes_the_notice_without_running_any_handler(
    tmp_path: Path,
) -> None:
    """A SIGTERM that reached another rank only: this rank's saves count as preemption
    saves too, and nothing installed for the signal runs here."""
    seen = _run(tmp_path, """
        import json, os, signal, threading
        import taskpoint
        from taskpoint import preemption

        ran = []
        signal.signal(signal.SIGTERM, lambda signum, frame: ran.append("framework"))
        preemption.install()
        before = preemption.requested()
        first = preemption.relay()
        again = preemption.relay(5.0, "SIGINT")
        ckpt = taskpoint.Checkpoint(os.environ["STORE"], keep=5)
        ckpt.save_sync(b"state")

        def made_before_the_signal():  # handed over later, from another thread
            with preemption.pinned(False):
                ckpt.save_sync(b"older state")

        thread = threading.Thread(target=made_before_the_signal)
        thread.start()
        thread.join()
        marked = [m.preemption for m in ckpt.committed()]
        print(json.dumps({"ran": ran, "before": before, "kept": first is again,
                          "signal": again.signal, "remaining": again.remaining(),
                          "marked": marked, "after": preemption.requested()}))
    """, TASKPOINT_GRACE_PERIOD="20")
    assert seen["ran"] == [] and seen["before"] is False and seen["kept"] is True
    assert seen["signal"] == "SIGTERM" and 10 < seen["remaining"] <= 20
    assert seen["marked"] == [False, True] and seen["after"] is True


DEDUP_TASK = """
import os, signal, sys, time
import taskpoint

env = taskpoint.TaskEnvironment(name="dedup", root=sys.argv[1], run_id="r1")


class Adapter:
    def __init__(self) -> None:
        self.calls = 0

    def on_preempt(self) -> None:
        self.calls += 1
        print("CALLS", self.calls, flush=True)


adapter = Adapter()


@env.task(retries=0)
def train() -> None:
    context = taskpoint.ctx()
    for _ in range(3):  # an adapter's hook at every training start
        context.on_preempt(adapter.on_preempt)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)


try:
    train()
except taskpoint.Preempted:
    print("PREEMPTED", adapter.calls, flush=True)
"""


def test_a_preempt_callback_registered_again_runs_once(tmp_path: Path) -> None:
    script = tmp_path / "dedup.py"
    script.write_text(DEDUP_TASK)
    done = subprocess.run(
        [sys.executable, str(script), f"file://{tmp_path / 'store'}"],
        capture_output=True, text=True, timeout=120,
    )
    assert "PREEMPTED 1" in done.stdout, done.stdout + done.stderr
    assert done.stdout.count("CALLS") == 1, done.stdout

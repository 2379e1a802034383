"""StepBoundary: a plain loop's save call becomes the step where a SIGTERM is saved.

Real tasks, real SIGTERMs, in processes of their own (signal handlers are per process);
each script prints one JSON line of what it saw, asserted here.
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


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}


def _run(tmp_path: Path, body: str, **env: str) -> dict[str, Any]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env={**_environ(), "STORE": str(tmp_path / "store"), **env}, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    seen: dict[str, Any] = json.loads(line)
    seen["log"] = done.stderr
    return seen


LOOP = """
    import json, logging, os, signal, subprocess, sys
    import taskpoint
    from taskpoint.runtime.step_boundary import StepBoundary

    logging.basicConfig(level=logging.INFO)
    env = taskpoint.TaskEnvironment(name="loop", root=os.environ["STORE"], run_id="r", keep=20)

    @env.task(retries=1, backoff=0.0, isolation=os.environ["ISOLATION"])
    def train(steps: int = 12) -> int:
        ckpt = taskpoint.ctx().checkpoint
        attempt = taskpoint.ctx().attempt
        restored = ckpt.load_sync()
        start = int(restored.read_bytes()) if restored else 0
        boundary = StepBoundary()
        boundary.begin()
        for step in range(start + 1, steps + 1):
            if attempt == 0 and step == 7:
                os.kill(os.getpid(), signal.SIGTERM)  # mid-step: only noted
                print("survived the signal", file=sys.stderr)
            if boundary.reached(step):
                saved = boundary.fits(None)
                if saved:
                    ckpt.save_sync(str(step).encode())
                boundary.stop(step, saved=saved, reason="no time left")
            if step % 5 == 0:
                ckpt.save_sync(str(step).encode())
        return steps

    if __name__ == "__main__":
        result = train()
        after = None
        if os.environ["ISOLATION"] == "inline":
            try:  # the deferral ended with the attempt: a SIGTERM now acts at once
                os.kill(os.getpid(), signal.SIGTERM)
                after = "ignored"
            except taskpoint.Preempted:
                after = "raised"
        shown = subprocess.run(
            [sys.executable, "-m", "taskpoint.cli", "show", "loop.train/r", "--root",
             os.environ["STORE"], "--json"], capture_output=True, text=True, check=True,
        )
        print(json.dumps({"result": result, "after": after,
                          "show": json.loads(shown.stdout)["attempts_detail"]}))
"""


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_a_sigterm_mid_step_is_saved_at_the_next_boundary_and_resumed_there(
    tmp_path: Path, isolation: str
) -> None:
    seen = _run(tmp_path, LOOP, ISOLATION=isolation)
    assert seen["result"] == 12 and "survived the signal" in seen["log"]
    detail = seen["show"]
    assert [a["outcome"] for a in detail] == ["preempted", "succeeded"]
    assert [a["step"] for a in detail] == [7, 12]
    assert [a["resumed_step"] for a in detail] == [None, 7]
    assert detail[0]["steps_lost"] == 0 and detail[0]["preemption_save"] == "committed"
    assert "SIGTERM at step 7: the preemption save committed" in seen["log"]
    assert seen["after"] == ("raised" if isolation == "inline" else None)


def test_a_grace_period_too_short_skips_the_save_and_the_record_says_missed(
    tmp_path: Path,
) -> None:
    seen = _run(tmp_path, LOOP, ISOLATION="inline", TASKPOINT_GRACE_PERIOD="0.2")
    detail = seen["show"]
    assert [a["outcome"] for a in detail] == ["preempted", "succeeded"]
    assert [a["resumed_step"] for a in detail] == [None, 5]  # the save before the signal
    assert detail[0]["steps_lost"] == 2 and detail[0]["preemption_save"] == "missed"
    assert "SIGTERM at step 7: no preemption save (no time left)" in seen["log"]


OUTSIDE = """
    import json, os, signal
    import taskpoint
    from taskpoint.format.history import read_attempts
    from taskpoint.runtime.step_boundary import StepBoundary
    from taskpoint.store.store import Store

    ckpt = taskpoint.Checkpoint(os.environ["STORE"])
    boundary = StepBoundary()
    boundary.begin()
    outcome = None
    try:
        for step in range(1, 10):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            if boundary.reached(step):
                ckpt.save_sync(str(step).encode())
                boundary.stop(step, saved=True, checkpoint=ckpt)
            ckpt.save_sync(str(step).encode())
    except taskpoint.Preempted as exc:
        outcome = str(exc)
    (record,) = read_attempts(Store(os.environ["STORE"]))
    print(json.dumps({"enabled": boundary.enabled, "outcome": outcome,
                      "record": [record.outcome, record.step, record.preemption_save]}))
"""


def test_outside_a_task_the_switch_turns_it_on_and_the_adapter_records_the_end(
    tmp_path: Path,
) -> None:
    seen = _run(tmp_path, OUTSIDE, TASKPOINT_SAVE_ON_PREEMPTION="1")
    assert seen["enabled"] is True
    assert seen["outcome"].startswith("SIGTERM at step 3: the preemption save committed")
    assert seen["record"] == ["preempted", 3, "committed"]


def test_outside_a_task_without_the_switch_a_sigterm_ends_the_process_as_before(
    tmp_path: Path,
) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(OUTSIDE))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env={**_environ(), "STORE": str(tmp_path / "store")}, timeout=300,
    )
    assert done.returncode == -15, done.stdout + done.stderr


CHANGED_PART = """
    import hashlib, json, os, signal
    from pathlib import Path
    import taskpoint
    from taskpoint.runtime.step_boundary import StepBoundary

    SIZE, CHANGED = int(os.environ["SIZE"]), int(os.environ["CHANGED"])
    background = os.environ["BACKGROUND"] == "1"
    env = taskpoint.TaskEnvironment(name="big", root=os.environ["STORE"], run_id="r", keep=5)
    state = Path("state")

    def digest(folder):
        return hashlib.sha256((folder / "weights.bin").read_bytes()).hexdigest()

    @env.task(retries=1, backoff=0.0)
    def train(steps: int = 8) -> dict:
        ckpt = taskpoint.ctx().checkpoint
        restored = ckpt.load_sync()
        if restored is not None:
            return {"resumed": int((restored / "step.txt").read_text()),
                    "weights": digest(restored)}
        state.mkdir()
        (state / "weights.bin").write_bytes(os.urandom(SIZE))
        boundary = StepBoundary()
        boundary.begin()
        for step in range(1, steps + 1):
            (state / "step.txt").write_text(str(step))
            if step == 6:  # a small part of the state changed since the save at 4
                with open(state / "weights.bin", "r+b") as fh:
                    fh.seek(SIZE // 2)
                    fh.write(os.urandom(CHANGED))
                print(json.dumps({"at_signal": digest(state)}))
                os.kill(os.getpid(), signal.SIGTERM)
            if boundary.reached(step):
                ckpt.save_sync(state, background=background)
                ckpt.wait()
                boundary.stop(step, saved=True)
            if step == 4:
                ckpt.save_sync(state, background=background)
                ckpt.wait()  # committed before the signal, as a save every N steps is
        return {"finished": steps}

    print(json.dumps(train()))
"""


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "upload-process"])
def test_a_preemption_save_uploads_only_the_chunks_that_changed(
    tmp_path: Path, background: bool
) -> None:
    """A 32 MiB state was saved; 1 MiB of it changes, then SIGTERM: the preemption save
    made at the next boundary uploads about that 1 MiB (the chunks around it), not the
    state, and the next attempt resumes from it with the changed bytes."""
    from taskpoint import Checkpoint
    from taskpoint.format._tree_save import CHUNK_AVG

    size, changed = 32 << 20, 1 << 20
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(CHANGED_PART))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env={**_environ(), "STORE": str(tmp_path / "store"), "SIZE": str(size),
             "CHANGED": str(changed), "BACKGROUND": str(int(background))}, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    at_signal, result = (json.loads(x) for x in done.stdout.splitlines() if x.startswith("{"))
    assert result == {"resumed": 6, "weights": at_signal["at_signal"]}, done.stderr
    preemption_save, before = Checkpoint(tmp_path / "store" / "big.train" / "r").committed()
    assert (preemption_save.step, preemption_save.preemption) == (6, True)
    assert (before.step, before.preemption) == (4, False)
    assert before.stats["uploaded"] >= size  # the first save sent the whole state
    # The changed megabyte, and at most the chunk (at most 4 x CHUNK_AVG) on each side of
    # it that content-defined chunking cuts differently: far below the state's size.
    uploaded = preemption_save.stats["uploaded"]
    assert changed <= uploaded <= changed + 2 * 4 * CHUNK_AVG, uploaded
    assert preemption_save.stats["reused"] >= size - changed - 2 * 4 * CHUNK_AVG


def test_a_fresh_process_estimates_its_first_preemption_save_from_bytes_and_link(
    tmp_path: Path,
) -> None:
    from taskpoint import Checkpoint, preemption
    from taskpoint.runtime import step_boundary
    from taskpoint.runtime.step_boundary import StepBoundary, estimate_save_s

    earlier = Checkpoint(tmp_path / "store")
    (tmp_path / "state.bin").write_bytes(os.urandom(8 << 20))
    earlier.save_sync(tmp_path / "state.bin")  # an earlier process's save, with its stats
    (manifest,) = earlier.committed()
    assert manifest.stats is not None
    rate = manifest.stats["uploaded"] / manifest.stats["upload_s"]

    never_saved = Checkpoint(tmp_path / "store")  # what a fresh process holds
    assert estimate_save_s(never_saved, 100 << 20) == pytest.approx(
        step_boundary.SAVE_OVERHEAD_S + (100 << 20) / step_boundary.ASSUMED_RATE
    )  # knowing nothing of the link, a documented rate
    assert estimate_save_s(never_saved, None) is None
    assert never_saved.load_sync() is not None  # it restored: it knows what that save cost
    assert estimate_save_s(never_saved, 100 << 20) == pytest.approx(
        step_boundary.SAVE_OVERHEAD_S + (100 << 20) / rate
    )

    boundary = StepBoundary()
    preemption.relay(5.0)  # a grace period of 5 s
    try:
        budget = boundary.budget()
        too_big = int((budget + 5) * rate)  # would take about 5 s longer than is left
        assert not boundary.fits(None, size=too_big, checkpoint=never_saved)
        assert boundary.fits(None, size=1 << 10, checkpoint=never_saved)
        assert boundary.fits(None)  # nothing known at all: tried while time is left
        assert not boundary.fits(budget + 1.0)  # a timed save is judged by its time
    finally:
        preemption.reset()

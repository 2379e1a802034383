"""Steps: what each failure cost, in the records, ``taskpoint show`` and the resume line.

Real tasks with real retries (inline and process-isolated) and a real SIGTERM; each script
prints one JSON line of what ``taskpoint show --json`` and the log said, asserted here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import taskpoint
from taskpoint import progress
from taskpoint.format.manifest import Manifest


def _run(tmp_path: Path, body: str, **env: str) -> dict[str, Any]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "STORE": str(tmp_path / "store"), **env}, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    seen: dict[str, Any] = json.loads(line)
    seen["log"] = done.stderr
    return seen


TASK = """
    import json, logging, os, signal, subprocess, sys
    import taskpoint
    from taskpoint import preemption

    logging.basicConfig(level=logging.INFO)
    env = taskpoint.TaskEnvironment(
        name="steps", root=os.environ["STORE"], run_id="r1", keep=20
    )

    @env.task(retries=3, backoff=0.0, isolation=os.environ["ISOLATION"])
    def train(steps: int = 20) -> int:
        ckpt = taskpoint.ctx().checkpoint
        attempt = taskpoint.ctx().attempt
        restored = ckpt.load_sync()
        start = int(restored.read_bytes()) if restored else 0
        with preemption.deferred():
            for step in range(start + 1, steps + 1):
                taskpoint.report_step(step)
                if attempt == 1 and step == 12:
                    os.kill(os.getpid(), signal.SIGTERM)  # preempted: saves at 12
                if step % 5 == 0 or preemption.requested():
                    ckpt.save_sync(str(step).encode())
                if preemption.requested():
                    return step  # saved at this step boundary: the runner records it preempted
                if attempt == 0 and step == 7:
                    raise RuntimeError("lost the node")  # 2 steps after the save at 5
                if attempt == 2 and step == 14:
                    preemption.install()  # a SIGTERM outside deferred: no save is made
                    raise taskpoint.Preempted("no time left to save")
        return steps

    if __name__ == "__main__":
        result = train()
        shown = subprocess.run(
            [sys.executable, "-m", "taskpoint.cli", "show", "steps.train/r1", "--root",
             os.environ["STORE"], "--json"], capture_output=True, text=True, check=True,
        )
        print(json.dumps({"result": result, "show": json.loads(shown.stdout)}))
"""


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_each_failure_records_the_step_it_reached_and_the_next_attempt_the_step_it_resumed(
    tmp_path: Path, isolation: str
) -> None:
    seen = _run(tmp_path, TASK, ISOLATION=isolation)
    assert seen["result"] == 20
    detail = seen["show"]["attempts_detail"]
    assert [a["outcome"] for a in detail] == ["failed", "preempted", "preempted", "succeeded"]
    assert [a["step"] for a in detail] == [7, 12, 14, 20]
    assert [a["resumed_step"] for a in detail] == [None, 5, 12, 12]
    # 7 - 5 by the exception; 0 by the preemption save; 14 - 12 when that save was missed
    assert [a["steps_lost"] for a in detail] == [2, 0, 2, None]
    assert [a["preemption_save"] for a in detail] == [None, "committed", "missed", None]
    checkpoints = [e for e in seen["show"]["timeline"] if e["event"] == "checkpoint"]
    marked = {e["key"]: (e["step"], e["preemption"]) for e in checkpoints}
    assert (12, True) in marked.values(), marked
    assert all(not p for s, p in marked.values() if s != 12)
    # the resume line, logged by the load itself (so every adapter logs it)
    assert "resuming at step 5 from save 0 of attempt 0; attempt 0 failed at step 7: " \
           "2 steps lost" in seen["log"]
    assert "resuming at step 12 from save 1 of attempt 1; attempt 1 preempted at step 12: " \
           "0 steps lost" in seen["log"]


def test_show_text_marks_preemption_saves_and_the_steps_each_failure_lost(
    tmp_path: Path,
) -> None:
    """What ``--json`` says above, in the text people read: the preemption save among the
    checkpoints, and at each attempt's end the step it reached, the step the next attempt
    resumed at, the steps lost, and whether its preemption save committed or was missed."""
    from click.testing import CliRunner
    from taskpoint.cli import main

    _run(tmp_path, TASK, ISOLATION="inline")
    shown = CliRunner().invoke(
        main, ["show", "steps.train/r1", "--root", str(tmp_path / "store")],
        env={"COLUMNS": "400"},  # one line per event, however long the error
    )
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    heads = [i for i, line in enumerate(lines) if re.search(r"attempt \d  ", line)]
    branches = [lines[a:b] for a, b in zip(heads, [*heads[1:], len(lines)], strict=True)]
    assert len(branches) == 4, shown.output

    def line_of(branch: list[str], needle: str) -> str:
        (line,) = [x for x in branch if needle in x]
        return line.removesuffix(" · traceback kept: show --verbose")  # each end kept one

    # attempt 0 failed 2 steps after its save at 5
    assert line_of(branches[0], "failed: RuntimeError: lost the node").endswith(
        "failed: RuntimeError: lost the node · at step 7 · next resumed at step 5: 2 steps lost"
    )
    # attempt 1 was preempted at 12 and saved there: its save is marked, nothing was lost
    assert " · bytes, 2 B · step 12 · preemption save · uploaded 2 B in " in line_of(
        branches[1], "checkpoint 000001-000000001"
    )
    assert line_of(branches[1], "preempted: ").endswith(
        "it counts as preempted, not succeeded · preemption save committed · at step 12 · "
        "next resumed at step 12: 0 steps lost"
    )
    # attempt 2 was preempted at 14 with no time to save: missed, 2 steps lost
    assert line_of(branches[2], "resumed from 000001-000000001.manifest.json · at step 12")
    assert line_of(branches[2], "preempted: ").endswith(
        "preempted: Preempted: no time left to save · preemption save MISSED · at step 14 · "
        "next resumed at step 12: 2 steps lost"
    )
    assert line_of(branches[3], "succeeded · ").endswith("succeeded · at step 20")
    marked = [x for x in lines if " · preemption save · " in x]
    assert marked == [line_of(branches[1], "checkpoint 000001-000000001")], "one save is marked"


def test_a_manifest_carries_the_step_of_a_background_save_made_in_the_upload_process(
    tmp_path: Path,
) -> None:
    """The step is taken when ``save`` is called, not when the upload commits."""
    ckpt = taskpoint.Checkpoint(tmp_path / "store", background_upload="process")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "w.bin").write_bytes(b"x" * 4096)
    try:
        taskpoint.report_step(40)
        ckpt.save_sync(tmp_path / "tree", background=True)
        taskpoint.report_step(41)
        ckpt.wait()
    finally:
        progress.reset()  # the step is per process: leave none to other tests
    (newest,) = ckpt.committed()
    assert (newest.step, newest.preemption) == (40, False)


def test_a_save_handed_over_later_from_another_thread_carries_the_step_pinned_there(
    tmp_path: Path,
) -> None:
    """An adapter serialising in a thread of its own calls ``save_sync`` after the loop
    moved on; the step pinned in that thread is the manifest's, and nobody else's."""
    import threading

    ckpt = taskpoint.Checkpoint(tmp_path / "store", keep=5)
    seen: list[int | None] = []
    try:
        taskpoint.report_step(40)

        def hand_over() -> None:
            with progress.pinned(40):
                taskpoint.report_step(43)  # the loop, meanwhile (same process-wide value)
                seen.append(progress.current_step())
                ckpt.save_sync(b"state at 40")

        thread = threading.Thread(target=hand_over)
        thread.start()
        thread.join()
        seen.append(progress.current_step())
        ckpt.save_sync(b"state at 43")
    finally:
        progress.reset()
    assert seen == [40, 43]
    assert [m.step for m in ckpt.committed()] == [43, 40]
    with pytest.raises(ValueError, match="step must be >= 0"), progress.pinned(-2):
        pass


@pytest.mark.parametrize("step", [-1, True, 2.0, "3"])
def test_a_step_that_is_not_a_count_is_refused(step: object) -> None:
    with pytest.raises((TypeError, ValueError), match="step must be"):
        taskpoint.report_step(step)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ['"step": -3', '"step": "7"', '"preemption": 1'])
def test_a_manifest_with_a_forged_step_or_preemption_mark_is_damaged(field: str) -> None:
    record = (
        '{"format": 1, "kind": "bytes", "name": null, "codec": "none", "size": 0, '
        '"checksum": "xxh3-128:99aa06d3014798d86001c324468d497f", '
        '"payload": "000000-000000000-abcd.payload", "attempt": 0, "seq": 0, '
        f'"created": 1.0, {field}}}'
    )
    with pytest.raises(taskpoint.CheckpointCorruptError, match=r"step|preemption"):
        Manifest.from_json(record.encode(), url="m")


SIGTERM_UNHANDLED = """
    import json, os, signal, time
    from taskpoint import preemption

    preemption.install()  # an adapter outside a task: no fallback, nothing before it
    os.kill(os.getpid(), signal.SIGTERM)  # outside deferred(): the default action
    time.sleep(30)
    print(json.dumps({"survived": True}))
"""


def test_a_sigterm_outside_deferred_with_no_other_handler_still_ends_the_process(
    tmp_path: Path,
) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SIGTERM_UNHANDLED))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -15, (done.returncode, done.stdout, done.stderr)

"""BoundarySaves: a plain loop's save call, whole (the dance taskpoint_pytorch's and
taskpoint_sklearn's save calls share): ``every`` picks the saves, a SIGTERM makes the next
call save at once and stop, a background save is waited for before the stop.

A real SIGTERM, in a process of its own (signal handlers are per process).
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

LOOP = """
    import json, os, signal, sys, time
    import taskpoint
    from taskpoint.runtime.boundary_saves import BoundarySaves

    ckpt = taskpoint.Checkpoint(os.environ["STORE"])
    saves = BoundarySaves(True, ranks=False, unit="chunks")
    seen = {"saved": []}
    try:
        saves.reached(ckpt, 1, every=0)
    except ValueError as exc:
        seen["every"] = str(exc)
    saves.begin(0)
    background = os.environ["BACKGROUND"] == "1"
    try:
        for step in range(1, 10):
            if step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # mid-step: only noted
            turn = saves.reached(ckpt, step, every=3)
            if not turn.save:
                continue
            with turn:
                data = str(step).encode()
                if background:
                    # Slow on purpose: the stop must wait for this commit.
                    saves.uploads.start(lambda data=data: (time.sleep(1), ckpt.save_sync(data)))
                else:
                    ckpt.save_sync(data)
            seen["saved"].append(step)
            saves.uploads.wait()  # a background save is timed once it committed
            seen["timed"] = saves.last_save_s is not None
    except taskpoint.Preempted as exc:
        seen["preempted"] = str(exc)
    seen["newest"] = ckpt.load_sync().read_bytes().decode()
    print(json.dumps(seen))
"""


def _run(tmp_path: Path, **env: str) -> dict[str, Any]:
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(LOOP))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
        env={**environ, "STORE": str(tmp_path / "store"), **env}, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    seen: dict[str, Any] = json.loads(line)
    return seen


@pytest.mark.parametrize("background", ["0", "1"])
def test_every_picks_the_saves_and_a_sigterm_saves_at_the_next_call_then_stops(
    tmp_path: Path, background: str
) -> None:
    seen = _run(tmp_path, BACKGROUND=background)
    assert seen["every"] == "every must be a positive int (chunks between saves); got 0"
    assert seen["saved"] == [3], seen  # step 5's save stopped the loop
    assert seen["timed"] is True
    assert "SIGTERM at step 5: the preemption save committed" in seen["preempted"], seen
    assert seen["newest"] == "5", seen  # a background one too: committed before the stop

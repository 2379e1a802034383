"""SIGTERM becomes a save at the next chunk, with the README quickstart's lines only.

Real tasks in real processes (_child_preempt.py), real signals, a file:// store; the
attempt records say where each attempt stopped and resumed, and the final estimator and
RNG must equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

CHILD = Path(__file__).parent / "_child_preempt.py"
CHUNKS = 12

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _train(
    tmp_path: Path, config: dict[str, Any], *, isolation: str = "inline", **env: str
) -> tuple[dict[str, Any], dict[str, Any], str]:
    import os

    out = tmp_path / "final.pkl"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    environ.update(TASKPOINT_ROOT=f"file://{tmp_path / 'store'}", ISOLATION=isolation, **env)
    done = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config), str(out)],
        env=environ, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    with out.open("rb") as fh:
        final = pickle.load(fh)  # written by the test's own child process
    return json.loads(line), final, done.stderr


def _assert_exact(cases: ModuleType, final: dict[str, Any]) -> None:
    case = cases.CASES["SGDClassifier"]
    cases.assert_same_fit(case, final["estimator"], cases.uninterrupted(case, CHUNKS))
    rng = np.random.default_rng(0)
    for _ in range(CHUNKS):
        case.chunk(rng)
    assert final["rng"] == rng.bit_generator.state


@pytest.mark.slow
def test_sigterm_mid_chunk_is_saved_with_that_chunk_and_resumed_there_exactly(
    cases: ModuleType, tmp_path: Path
) -> None:
    at = random.Random().randint(1, CHUNKS - 1)
    seen, final, log = _train(tmp_path, {"every": None, "fail": {"0": ["term", at]}})
    first, second = seen["attempts"]
    assert (first["outcome"], first["step"], first["preemption_save"]) == (
        "preempted", at, "committed"), (at, seen)
    assert first["steps_lost"] == 0 and second["resumed_step"] == at, (at, seen)
    assert [s["step"] for s in seen["saves"] if s["preemption"]] == [at]
    assert f"SIGTERM at step {at}: the preemption save committed" in log
    _assert_exact(cases, final)


@pytest.mark.slow
def test_saving_every_3_chunks_sigterm_exception_and_sigkill_each_lose_at_most_the_rest(
    cases: ModuleType, tmp_path: Path
) -> None:
    """Process isolation, ``save_sync(bundle, every=3)`` after every chunk: SIGTERM at a
    random chunk is saved with it; an exception one chunk after a save resumes from that
    save (one chunk lost); a SIGKILL resumes from the last commit."""
    at = random.Random().randint(1, 4)  # attempt 1 resumes at ``at``
    seen, final, _ = _train(
        tmp_path,
        {"every": 3, "fail": {"0": ["term", at], "1": ["raise", 8], "2": ["kill", 11]}},
        isolation="process",
    )
    a0, a1, a2, a3 = seen["attempts"]
    assert (a0["outcome"], a0["step"], a0["preemption_save"], a0["steps_lost"]) == (
        "preempted", at, "committed", 0), (at, seen)
    assert a1["resumed_step"] == at, (at, seen)
    assert (a1["outcome"], a1["step"], a1["steps_lost"]) == ("failed", 7, 1), (at, seen)
    assert a2["resumed_step"] == 6
    assert (a2["outcome"], a3["resumed_step"], a3["outcome"]) == ("crashed", 9, "succeeded")
    assert [s["step"] for s in seen["saves"] if s["preemption"]] == [at]
    _assert_exact(cases, final)


@pytest.mark.slow
def test_a_grace_period_too_short_for_the_save_keeps_the_previous_checkpoint(
    cases: ModuleType, tmp_path: Path
) -> None:
    seen, final, log = _train(
        tmp_path, {"every": 3, "fail": {"0": ["term", 5]}}, TASKPOINT_GRACE_PERIOD="0.3"
    )
    first, second = seen["attempts"]
    assert (first["outcome"], first["step"], first["preemption_save"]) == (
        "preempted", 5, "missed"), seen
    assert second["resumed_step"] == 3 and first["steps_lost"] == 2, seen
    assert "SIGTERM at step 5: no preemption save" in log
    _assert_exact(cases, final)

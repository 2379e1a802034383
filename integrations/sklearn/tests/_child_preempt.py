"""Child process for the preemption tests: a taskpoint task training ``SGDClassifier``
chunk by chunk with the README quickstart's lines, its attempts failing as told.

Usage: python _child_preempt.py CONFIG_JSON OUT

``TASKPOINT_ROOT`` names the store; ``ISOLATION`` the task's isolation. CONFIG_JSON holds
``every`` (``save_sync``'s argument; ``null``: a save per chunk, as in the README) and
``fail``: ``{attempt: [kind, chunk]}`` with kind ``term`` (SIGTERM to itself while that
chunk trains), ``raise`` (an exception before it) or ``kill`` (SIGKILL before it); chunks
count from 1. The final attempt pickles its bundle's estimator and RNG state to OUT; then
the script prints one JSON line: the attempt records and each committed save's step.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import cases
import taskpoint
from taskpoint.format.history import read_attempts, steps_lost
from taskpoint.store.store import Store
from taskpoint_sklearn import TaskpointSklearnCheckpoint

CHUNKS = 12
CASE = cases.CASES["SGDClassifier"]

env = taskpoint.TaskEnvironment(name="skpre", run_id="r", keep=50)


@env.task(retries=3, backoff=0.0, isolation=os.environ.get("ISOLATION", "inline"))  # type: ignore[call-overload]
def train(config: dict[str, Any], out: str) -> None:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    kind, at = config["fail"].get(str(context.attempt), [None, None])
    ckpt = TaskpointSklearnCheckpoint(context.checkpoint)
    bundle = ckpt.resume_sync(CASE.make(), rng=np.random.default_rng(0))
    for i in range(bundle.progress, CHUNKS):
        if i + 1 == at:
            print(f"attempt {context.attempt}: {kind} at chunk {at}", file=sys.stderr, flush=True)
            if kind == "term":
                os.kill(os.getpid(), signal.SIGTERM)  # noted; this chunk still trains
            elif kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "raise":
                raise RuntimeError(f"simulated failure before chunk {at}")
        cases.train_chunk(CASE, bundle.estimator, bundle.rng)
        bundle.progress = i + 1
        ckpt.save_sync(bundle, every=config["every"])
    with open(out, "wb") as fh:
        pickle.dump({"estimator": bundle.estimator, "rng": bundle.rng.bit_generator.state}, fh)


def main() -> None:
    train(json.loads(sys.argv[1]), sys.argv[2])
    url = f"{os.environ['TASKPOINT_ROOT']}/skpre.train/r"
    records = read_attempts(Store(url))
    attempts = [
        {
            "outcome": r.outcome, "step": r.step, "resumed_step": r.resumed_step,
            "preemption_save": r.preemption_save, "resumed_at": r.resumed_at,
            "steps_lost": steps_lost(r, after.resumed_step) if after is not None else None,
        }
        for r, after in zip(records, [*records[1:], None], strict=True)
    ]
    saves = [
        {"attempt": m.attempt, "step": m.step, "preemption": m.preemption, "created": m.created}
        for m in reversed(taskpoint.Checkpoint(url).committed())
    ]
    print(json.dumps({"attempts": attempts, "saves": saves}), flush=True)


if __name__ == "__main__":
    main()

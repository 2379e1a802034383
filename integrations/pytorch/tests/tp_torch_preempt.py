"""Child process for the preemption tests: a taskpoint task that trains with TaskpointState,
its attempts failing as told, with the README quickstart's lines only.

Usage: python tp_torch_preempt.py CONFIG_JSON OUT

``TASKPOINT_ROOT`` names the store; ``ISOLATION`` the task's isolation (``inline`` or
``process``). CONFIG_JSON holds ``loop`` (``"epochs"``: ``tp_torch_training.run``, one save
per epoch; ``"steps"``: ``run_steps`` with ``every``), ``background``, ``slow_upload``
(seconds each upload sleeps first) and ``fail``: ``{attempt: [kind, step]}`` with kind
``term`` (SIGTERM to itself before that step's work), ``raise`` (an exception there) or
``kill`` (SIGKILL there). The final attempt writes the trained state to OUT; then the
script prints one JSON line: the attempt records and each committed save's step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import taskpoint
import tp_torch_training as lib
from taskpoint.format.history import read_attempts, steps_lost
from taskpoint.store.store import Store

env = taskpoint.TaskEnvironment(name="preempt", run_id="r", keep=50)


@env.task(retries=3, backoff=0.0, isolation=os.environ.get("ISOLATION", "inline"))  # type: ignore[call-overload]
def train(config: dict[str, Any], out: str) -> None:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    torch.set_num_threads(1)
    kind, at = config["fail"].get(str(context.attempt), [None, None])

    def before_step(step: int) -> None:
        if step != at:
            return
        print(f"attempt {context.attempt}: {kind} before step {step}", file=sys.stderr, flush=True)
        if kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "raise":
            raise RuntimeError(f"simulated failure before step {step}")

    checkpoint: Any = context.checkpoint
    if config.get("slow_upload"):
        checkpoint = lib.SlowCheckpoint(checkpoint, config["slow_upload"])
    parts = lib.build()
    background = bool(config.get("background"))
    if config["loop"] == "epochs":
        state = parts.state(blocking=not background)
        result = lib.run(parts, state, checkpoint, before_step=before_step, background=background)
    else:
        data = lib.data_generator()
        state = parts.state(generators={"data": data}, blocking=not background)
        result = lib.run_steps(
            parts, data, state, checkpoint, every=config["every"], before_step=before_step,
            background=background,
        )
    torch.save(result, out)


def main() -> None:
    config = json.loads(sys.argv[1])
    train(config, sys.argv[2])
    url = f"{os.environ['TASKPOINT_ROOT']}/preempt.train/r"
    records = read_attempts(Store(url))
    attempts = [
        {
            "outcome": r.outcome, "step": r.step, "resumed_step": r.resumed_step,
            "preemption_save": r.preemption_save, "ended": r.ended, "resumed_at": r.resumed_at,
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

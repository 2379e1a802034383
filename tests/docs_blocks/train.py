"""The task file the command-line guide's block runs (``tests/test_docs.py`` copies it
to ``train.py`` in an empty working directory).

``train`` counts ``steps`` steps, saving the count after each one. Attempt 0 dies at step 3
on purpose, so the run needs ``--retries``; it returns where its last attempt started.
"""

from __future__ import annotations

import taskpoint

env = taskpoint.TaskEnvironment(name="train")


@env.task
def train(steps: int = 10) -> dict[str, int]:
    """Returns ``{"attempt": <last attempt>, "resumed_at": <step it started from>}``."""
    context = taskpoint.ctx()
    ckpt = context.checkpoint
    assert ckpt is not None
    prev = ckpt.load_sync()
    start = int(prev.read_bytes()) if prev else 0
    for step in range(start, steps):
        if context.attempt == 0 and step == 3:
            raise RuntimeError("attempt 0 dies at step 3 on purpose")
        ckpt.save_sync(str(step + 1).encode())
    return {"attempt": context.attempt or 0, "resumed_at": start}

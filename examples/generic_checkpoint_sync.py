"""A counter that fails on purpose and resumes from its checkpoint (sync version).

Run: uv run python examples/generic_checkpoint_sync.py

Each attempt prints where it starts. With n_iterations=10 and 3 retries, attempts 0-2
fail at iterations 3, 6 and 9, each later than the last, and attempt 3 returns 9.
"""

from __future__ import annotations

import taskpoint

env = taskpoint.TaskEnvironment(name="generic_counter_sync")

RETRIES = 3


@env.task(retries=RETRIES, backoff=0.0)
def count_up(n_iterations: int = 10) -> int:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    checkpoint = context.checkpoint

    saved = checkpoint.load_sync()  # None on the first attempt
    start = int(saved.read_bytes()) if saved else 0
    print(f"attempt {context.attempt}: starting at iteration {start}", flush=True)

    fail_every = n_iterations // RETRIES
    index = start
    for index in range(start, n_iterations):
        if index > start and index % fail_every == 0:
            raise RuntimeError(f"simulated crash at iteration {index}")
        checkpoint.save_sync(str(index + 1).encode())
    return index


if __name__ == "__main__":
    print("result:", count_up())

"""Incremental scikit-learn training that fails on purpose and resumes from its checkpoint.

The spec's ``incremental_sgd``, with taskpoint_sklearn: after each chunk the estimator,
the chunk counter and the NumPy generator the chunks are drawn from are saved as a skops
bundle; each retry restores them and continues from the next chunk. The final model is
compared with a run that never failed: it is identical.

Run it with ``uv run python examples/sklearn_partial_checkpoint.py``. Checkpoints go to
the embedded local store, ``./.taskpoint/checkpoints`` (or ``$TASKPOINT_ROOT``).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import taskpoint
from sklearn.linear_model import SGDClassifier
from taskpoint_sklearn import TaskpointSklearnCheckpoint

RETRIES = 3
CLASSES = np.array([0, 1])

env = taskpoint.TaskEnvironment(name="sklearn_partial")


def new_classifier() -> SGDClassifier:
    return SGDClassifier(max_iter=1, tol=None, random_state=0)


def make_chunk(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((32, 8))
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    return x, y


@env.task(retries=RETRIES)
async def incremental_sgd(chunks: int = 10) -> SGDClassifier:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    checkpoint = TaskpointSklearnCheckpoint(context.checkpoint)

    # Resume the estimator, progress and generator from the previous attempt, if any.
    bundle = await checkpoint.resume(new_classifier(), rng=np.random.default_rng(0))
    start = bundle.progress
    print(f"attempt {context.attempt}: starting at chunk {start} of {chunks}")

    failure_interval = chunks // RETRIES
    for i in range(start, chunks):
        x, y = make_chunk(bundle.rng)  # draw from the bundle's generator: it is restored too
        bundle.partial_fit(x, y, classes=CLASSES)

        if i > start and i % failure_interval == 0:
            # Simulate a failure so the next attempt resumes from the checkpoint
            raise RuntimeError(f"Simulated failure at chunk {i}")

        # Save estimator, progress and generator state (skops) to the checkpoint store.
        bundle.progress = i + 1
        await checkpoint.save(bundle)

    return bundle.estimator


def uninterrupted(chunks: int = 10) -> SGDClassifier:
    """The same training without failures or checkpoints, for comparison."""
    clf, rng = new_classifier(), np.random.default_rng(0)
    for _ in range(chunks):
        x, y = make_chunk(rng)
        clf.partial_fit(x, y, classes=CLASSES)
    return clf


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    clf = asyncio.run(incremental_sgd())
    reference = uninterrupted()
    same = np.array_equal(clf.coef_, reference.coef_) and np.array_equal(
        clf.intercept_, reference.intercept_
    )
    test_x, test_y = make_chunk(np.random.default_rng(1))
    print(f"test accuracy {clf.score(test_x, test_y):.3f}")
    print(f"identical to an uninterrupted run: {same}")
    if not same:
        raise SystemExit("resumed model differs from the uninterrupted one")


if __name__ == "__main__":
    main()

"""Training interrupted by exceptions resumes to exactly the uninterrupted result."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
import taskpoint
from sklearn.linear_model import SGDClassifier
from taskpoint_sklearn import PartialFitBundle, TaskpointSklearnCheckpoint

CASE_NAMES = [
    "SGDClassifier",
    "SGDRegressor",
    "MiniBatchKMeans",
    "IncrementalPCA",
    "MultinomialNB",
    "MLPClassifier",
    "MLPClassifier-sgd",
    "Pipeline",
]
FAIL_AT = (2, 4)
"""Attempt n fails at chunk FAIL_AT[n], after training on it and before saving it."""

ONE_OBJECT_STORE = pytest.mark.stores("file", "s3")
"""For the tests of what the estimators and generators carry over, the same bytes on every
store; ``test_bundle_is_a_snapshot_and_restores_all_fields`` runs on every store."""


def _current_checkpoint() -> taskpoint.CheckpointLike:
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None
    return context.checkpoint


@ONE_OBJECT_STORE
@pytest.mark.parametrize("name", CASE_NAMES)
def test_exception_interrupted_run_equals_uninterrupted(
    name: str, cases: ModuleType, store_url: str
) -> None:
    case = cases.CASES[name]
    env = taskpoint.TaskEnvironment(name="sk", root=store_url)
    starts: list[int] = []

    @env.task(retries=len(FAIL_AT), backoff=0)
    def train() -> PartialFitBundle:
        context = taskpoint.ctx()
        assert context is not None
        ckpt = TaskpointSklearnCheckpoint(_current_checkpoint())
        bundle = ckpt.resume_sync(
            case.make(), rng=np.random.default_rng(0), metadata={"case": name}
        )
        starts.append(bundle.progress)
        for i in range(bundle.progress, cases.N_CHUNKS):
            cases.train_chunk(case, bundle.estimator, bundle.rng)
            if context.attempt < len(FAIL_AT) and i == FAIL_AT[context.attempt]:
                raise RuntimeError(f"simulated failure at chunk {i}")
            bundle.progress = i + 1
            ckpt.save_sync(bundle)
        return bundle

    bundle = train()

    assert starts == [0, *FAIL_AT]
    assert bundle.progress == cases.N_CHUNKS
    assert bundle.metadata == {"case": name}
    cases.assert_same_fit(case, bundle.estimator, cases.uninterrupted(case))
    reference_rng = np.random.default_rng(0)
    for _ in range(cases.N_CHUNKS):
        case.chunk(reference_rng)
    assert bundle.rng is not None
    assert bundle.rng.bit_generator.state == reference_rng.bit_generator.state


@ONE_OBJECT_STORE
@pytest.mark.parametrize("name", ["SGDClassifier", "MLPClassifier"])
async def test_async_task_resumes_exactly(name: str, cases: ModuleType, store_url: str) -> None:
    case = cases.CASES[name]
    env = taskpoint.TaskEnvironment(name="sk", root=store_url)
    starts: list[int] = []

    @env.task(retries=1, backoff=0)
    async def train() -> Any:
        ckpt = TaskpointSklearnCheckpoint(_current_checkpoint())
        bundle = await ckpt.resume(case.make(), rng=np.random.default_rng(0))
        starts.append(bundle.progress)
        for i in range(bundle.progress, cases.N_CHUNKS):
            bundle.partial_fit(*case.chunk(bundle.rng)[:2], **case.fit_params)
            if not starts[1:] and i == 3:
                raise RuntimeError("simulated failure")
            bundle.progress = i + 1
            await ckpt.save(bundle)
        return bundle.estimator

    estimator = await train()

    assert starts == [0, 3]
    cases.assert_same_fit(case, estimator, cases.uninterrupted(case))


@ONE_OBJECT_STORE
def test_resume_without_saved_rng_diverges(cases: ModuleType, store_url: str) -> None:
    """Control: the comparison is sensitive. Restoring the estimator but restarting the
    generator (the spec's plain pickle example does this) gives different coefficients."""
    case = cases.CASES["SGDClassifier"]
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url, attempt=0))
    bundle = ckpt.resume_sync(case.make(), rng=np.random.default_rng(0))
    for i in range(3):
        cases.train_chunk(case, bundle.estimator, bundle.rng)
        bundle.progress = i + 1
        ckpt.save_sync(bundle)

    restored = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url, attempt=1)).load_sync()
    assert restored is not None and restored.progress == 3
    fresh_rng = np.random.default_rng(0)
    for _ in range(3, cases.N_CHUNKS):
        cases.train_chunk(case, restored.estimator, fresh_rng)

    reference = cases.uninterrupted(case)
    with pytest.raises(AssertionError, match="differ"):
        cases.assert_same_fit(case, restored.estimator, reference)


def test_bundle_is_a_snapshot_and_restores_all_fields(store_url: str) -> None:
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url))
    assert ckpt.load_sync() is None
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 3))
    bundle = PartialFitBundle(
        SGDClassifier(random_state=0),
        progress=1,
        rng=rng,
        metadata={"samples": 16, "loss": [0.5, 0.25], "tag": "a", "w": np.arange(3.0)},
    )
    bundle.partial_fit(x, (x[:, 0] > 0).astype(int), classes=[0, 1])
    ckpt.save_sync(bundle)
    saved_coef = bundle.estimator.coef_.copy()
    saved_state = rng.bit_generator.state
    bundle.partial_fit(x, (x[:, 1] > 0).astype(int))  # after the save: not in it
    rng.standard_normal(5)

    restored = ckpt.load_sync()

    assert restored is not None
    assert restored.progress == 1
    assert np.array_equal(restored.estimator.coef_, saved_coef)
    assert not np.array_equal(restored.estimator.coef_, bundle.estimator.coef_)
    assert restored.rng is not None and restored.rng is not rng
    assert restored.rng.bit_generator.state == saved_state
    assert restored.metadata["samples"] == 16 and restored.metadata["tag"] == "a"
    assert restored.metadata["loss"] == [0.5, 0.25]
    assert np.array_equal(restored.metadata["w"], np.arange(3.0))


@ONE_OBJECT_STORE
@pytest.mark.parametrize("bit_generator", ["PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"])
def test_every_numpy_bit_generator_continues_its_stream(bit_generator: str, store_url: str) -> None:
    rng = np.random.Generator(getattr(np.random, bit_generator)(123))
    rng.standard_normal(7)  # mid-stream, with a buffered value for some generators
    rng.integers(0, 10, 3, dtype=np.uint32)
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url))
    ckpt.save_sync(PartialFitBundle(SGDClassifier(), rng=rng))

    restored = ckpt.load_sync()

    assert restored is not None and restored.rng is not None
    assert type(restored.rng.bit_generator).__name__ == bit_generator
    assert np.array_equal(restored.rng.random(50), rng.random(50))
    assert np.array_equal(restored.rng.integers(0, 1 << 30, 9), rng.integers(0, 1 << 30, 9))

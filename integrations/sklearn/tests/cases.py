"""Estimators under test, their data, and exact comparison of fitted state.

Shared by the in-process tests (loaded by ``conftest.py``) and the child training script
(``_child_train.py``), so both train exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.cluster import MiniBatchKMeans
from sklearn.decomposition import IncrementalPCA
from sklearn.linear_model import SGDClassifier, SGDRegressor
from sklearn.naive_bayes import MultinomialNB
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

N_CHUNKS = 6
N_FEATURES = 6


@dataclass(frozen=True)
class Case:
    """One estimator: how to build it, draw a chunk, and which attributes matter most."""

    make: Callable[[], Any]
    chunk: Callable[[np.random.Generator], tuple[np.ndarray, np.ndarray | None]]
    key: tuple[str, ...]
    fit_params: dict[str, Any] = field(default_factory=dict)


def _classification(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((24, N_FEATURES))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5).astype(int)
    return x, y


def _regression(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((24, N_FEATURES))
    return x, x @ np.arange(1.0, N_FEATURES + 1) + 0.1 * rng.standard_normal(24)


def _unsupervised(rng: np.random.Generator) -> tuple[np.ndarray, None]:
    centres = np.array([[0.0] * N_FEATURES, [4.0] * N_FEATURES, [-4.0] * N_FEATURES])
    return centres[rng.integers(0, 3, 24)] + rng.standard_normal((24, N_FEATURES)), None


def _counts(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(0, 6, (24, N_FEATURES)).astype(float)
    return x, (x[:, 0] > x[:, 1]).astype(int)


CLASSES = {"classes": np.array([0, 1, 2])}

CASES: dict[str, Case] = {
    "SGDClassifier": Case(
        lambda: SGDClassifier(random_state=0, average=True),
        _classification, ("coef_", "intercept_"), CLASSES,
    ),
    "SGDRegressor": Case(
        lambda: SGDRegressor(random_state=0), _regression, ("coef_", "intercept_")
    ),
    "MiniBatchKMeans": Case(
        lambda: MiniBatchKMeans(n_clusters=3, random_state=0, reassignment_ratio=0.2),
        _unsupervised, ("cluster_centers_",),
    ),
    "IncrementalPCA": Case(
        lambda: IncrementalPCA(n_components=3), _unsupervised, ("components_", "mean_")
    ),
    "MultinomialNB": Case(
        MultinomialNB, _counts, ("feature_count_", "feature_log_prob_"), {"classes": [0, 1]}
    ),
    "MLPClassifier": Case(
        lambda: MLPClassifier(hidden_layer_sizes=(8,), batch_size=8, random_state=0),
        _classification, ("coefs_", "intercepts_"), CLASSES,
    ),
    "MLPClassifier-sgd": Case(
        lambda: MLPClassifier(hidden_layer_sizes=(8,), solver="sgd", batch_size=8, random_state=0),
        _classification, ("coefs_", "intercepts_"), CLASSES,
    ),
    "Pipeline": Case(
        lambda: make_pipeline(StandardScaler(), SGDClassifier(random_state=0)),
        _classification, ("sgdclassifier.coef_", "standardscaler.mean_"), CLASSES,
    ),
}


def fitted_state(estimator: Any) -> dict[str, Any]:
    """Every public fitted attribute (``name_``), recursing into Pipeline steps."""
    if isinstance(estimator, Pipeline):
        state: dict[str, Any] = {}
        for name, step in estimator.steps:
            state.update({f"{name}.{k}": v for k, v in fitted_state(step).items()})
        return state
    return {
        k: v for k, v in vars(estimator).items()
        if k.endswith("_") and not k.startswith("_") and not k.endswith("__")
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
            and a.dtype == b.dtype and np.array_equal(a, b)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return bool(a == b)


def assert_same_fit(case: Case, got: Any, want: Any) -> None:
    """Assert ``got`` and ``want`` hold bitwise-identical fitted state."""
    g, w = fitted_state(got), fitted_state(want)
    for name in case.key:
        assert name in w, f"reference lacks {name}"
    assert sorted(g) == sorted(w)
    differ = [k for k in w if not _equal(g[k], w[k])]
    assert not differ, f"fitted attributes differ from the uninterrupted run: {differ}"


def train_chunk(case: Case, estimator: Any, rng: np.random.Generator) -> None:
    """Draw one chunk from ``rng`` and train on it, the way every test loop does."""
    from taskpoint_sklearn import partial_fit

    x, y = case.chunk(rng)
    partial_fit(estimator, x, y, **case.fit_params)


def uninterrupted(case: Case, chunks: int = N_CHUNKS, seed: int = 0) -> Any:
    """The reference: the same loop, never interrupted, never checkpointed."""
    estimator, rng = case.make(), np.random.default_rng(seed)
    for _ in range(chunks):
        train_chunk(case, estimator, rng)
    return estimator


def train_all(root: Any, on_trained: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """Train every case round-robin, chunk by chunk, each against its own checkpoint
    ``file://{root}/{name}``, resuming from whatever is saved there.

    ``on_trained(chunk, name)`` runs after each chunk's ``partial_fit`` and before its save
    (the kill tests die there). Prints ``START {json of progress per case}`` first.
    Returns the finished bundles by case name.
    """
    import json

    import taskpoint
    from taskpoint_sklearn import TaskpointSklearnCheckpoint

    ckpts = {
        name: TaskpointSklearnCheckpoint(taskpoint.Checkpoint(f"file://{root}/{name}"))
        for name in CASES
    }
    bundles = {
        name: ckpts[name].resume_sync(case.make(), rng=np.random.default_rng(0))
        for name, case in CASES.items()
    }
    print("START " + json.dumps({name: b.progress for name, b in bundles.items()}), flush=True)
    for i in range(N_CHUNKS):
        for name, case in CASES.items():
            bundle = bundles[name]
            if bundle.progress > i:
                continue
            train_chunk(case, bundle.estimator, bundle.rng)
            if on_trained is not None:
                on_trained(i, name)
            bundle.progress = i + 1
            ckpts[name].save_sync(bundle)
    return bundles

"""Argument checks, refusals, errors, exports and the version check."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import taskpoint
import taskpoint_sklearn
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression, SGDClassifier, SGDRegressor
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler
from taskpoint_sklearn import (
    BundleFormatError,
    PartialFitBundle,
    TaskpointSklearnCheckpoint,
    UntrustedTypesError,
    check_partial_fit,
    partial_fit,
    supports_partial_fit,
)

NO_PARTIAL_FIT = [
    (LogisticRegression(), "LogisticRegression has no partial_fit"),
    (MLPClassifier(solver="lbfgs"), "MLPClassifier has no partial_fit"),
    (
        make_pipeline(StandardScaler(), LogisticRegression()),
        "last step 'logisticregression' \\(LogisticRegression\\) has no partial_fit",
    ),
    (Pipeline([("scale", StandardScaler()), ("end", "passthrough")]), "last step 'end'"),
]


@pytest.mark.parametrize(("estimator", "message"), NO_PARTIAL_FIT)
def test_estimators_without_partial_fit_are_refused(estimator: Any, message: str) -> None:
    assert not supports_partial_fit(estimator)
    with pytest.raises(TypeError, match=message):
        PartialFitBundle(estimator)
    with pytest.raises(TypeError, match=message):
        check_partial_fit(estimator)
    with pytest.raises(TypeError, match=message):
        partial_fit(estimator, np.eye(3), [0, 1, 1])
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint("memory://tp-sk/refuse"))
    with pytest.raises(TypeError, match="use an estimator with partial_fit"):
        ckpt.resume_sync(estimator)


def test_every_case_supports_partial_fit(cases: ModuleType) -> None:
    for case in cases.CASES.values():
        assert supports_partial_fit(case.make())


def test_estimator_swapped_after_construction_is_refused_at_save() -> None:
    bundle = PartialFitBundle(SGDClassifier())
    bundle.estimator = LogisticRegression()
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint("memory://tp-sk/swap"))
    with pytest.raises(TypeError, match="LogisticRegression has no partial_fit"):
        ckpt.save_sync(bundle)


def test_pipeline_step_without_partial_fit_must_be_fitted() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 4))
    y = (x[:, 0] > 0).astype(int)
    pipe = make_pipeline(PCA(n_components=2), SGDClassifier(random_state=0))
    with pytest.raises(ValueError, match="'pca' \\(PCA\\) has no partial_fit and is not fitted"):
        partial_fit(pipe, x, y, classes=[0, 1])

    pipe.steps[0][1].fit(x)
    pipe = Pipeline(
        [("pca", pipe.steps[0][1]), ("skip", "passthrough"),
         ("tanh", FunctionTransformer(np.tanh)), ("clf", SGDClassifier(random_state=0))]
    )
    partial_fit(pipe, x, y, classes=[0, 1])
    expected = SGDClassifier(random_state=0).partial_fit(
        np.tanh(pipe.steps[0][1].transform(x)), y, classes=[0, 1]
    )
    assert np.array_equal(pipe.steps[-1][1].coef_, expected.coef_)
    assert pipe.predict(x).shape == (20,)


def test_bad_arguments_are_named() -> None:
    url = "memory://tp-sk/args"
    with pytest.raises(TypeError, match="ctx\\(\\) is None outside a task"):
        TaskpointSklearnCheckpoint(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got str"):
        TaskpointSklearnCheckpoint(url)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="format must be one of \\['skops', 'pickle', 'joblib'\\]"):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(url), format="yaml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="filename"):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(url), filename="a/b")
    with pytest.raises(TypeError, match=r"numpy\.random\.Generator"):
        PartialFitBundle(SGDClassifier(), rng=np.random.RandomState(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="progress must be a non-negative int; got -1"):
        PartialFitBundle(SGDClassifier(), progress=-1)
    with pytest.raises(TypeError, match="metadata must be a mapping"):
        PartialFitBundle(SGDClassifier(), metadata=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes a PartialFitBundle"):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(url)).save_sync(SGDClassifier())  # type: ignore[arg-type]


def test_resume_refuses_a_checkpoint_of_another_estimator_or_rng_use(store_url: str) -> None:
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url))
    fresh = ckpt.resume_sync(SGDClassifier(), rng=np.random.default_rng(0), metadata={"a": 1})
    assert fresh.progress == 0 and fresh.metadata == {"a": 1}
    x = np.eye(3)
    fresh.partial_fit(x, [0, 1, 1], classes=[0, 1])
    fresh.progress = 1
    ckpt.save_sync(fresh)

    with pytest.raises(BundleFormatError, match="holds a SGDClassifier but this run trains a SGDRegressor"):
        ckpt.resume_sync(SGDRegressor(), rng=np.random.default_rng(0))
    with pytest.raises(BundleFormatError, match="saved with an rng but this run passes none"):
        ckpt.resume_sync(SGDClassifier())
    assert ckpt.resume_sync(SGDClassifier(), rng=np.random.default_rng(5)).progress == 1


def test_checkpoints_that_are_not_bundles_are_refused(store_url: str, tmp_path: Path) -> None:
    import skops.io as sio

    raw = taskpoint.Checkpoint(store_url)
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("x")
    raw.save_sync(tmp_path / "d")
    with pytest.raises(BundleFormatError, match="not a single file"):
        ckpt.load_sync()

    raw.save_sync(sio.dumps({"estimator": 1}))
    with pytest.raises(BundleFormatError, match="not a taskpoint_sklearn bundle"):
        ckpt.load_sync()

    raw.save_sync(sio.dumps({"taskpoint_sklearn": 1, "estimator": SGDClassifier(), "progress": 2}))
    with pytest.raises(BundleFormatError, match="invalid bundle"):
        ckpt.load_sync()

    raw.save_sync(sio.dumps({"taskpoint_sklearn": 99}))
    with pytest.raises(BundleFormatError, match="layout 99"):
        ckpt.load_sync()

    raw.save_sync(b"PK\x03\x04 not really a zip")
    with pytest.raises(BundleFormatError, match="not a readable skops file"):
        ckpt.load_sync()


class DirCheckpoint:
    """Another system's checkpoint object: not taskpoint's, same four methods."""

    def __init__(self) -> None:
        self.saved: bytes | None = None
        self.name = ""

    def save_sync(self, data: Any, /) -> None:
        self.name, self.saved = Path(data).name, Path(data).read_bytes()

    async def save(self, data: Any, /) -> None:
        self.save_sync(data)

    def load_sync(self) -> Path | None:
        if self.saved is None:
            return None
        path = Path(tempfile.mkdtemp()) / self.name
        path.write_bytes(self.saved)
        return path

    async def load(self) -> Path | None:
        return self.load_sync()


async def test_any_checkpoint_like_object_works() -> None:
    other = DirCheckpoint()
    ckpt = TaskpointSklearnCheckpoint(other)
    assert await ckpt.load() is None
    bundle = await ckpt.resume(SGDClassifier(random_state=0), rng=np.random.default_rng(1))
    bundle.partial_fit(np.eye(3), [0, 1, 1], classes=[0, 1])
    bundle.progress = 3
    await ckpt.save(bundle)

    restored = ckpt.load_sync()

    assert other.name == "sklearn-bundle.skops"
    assert restored is not None and restored.progress == 3
    assert np.array_equal(restored.estimator.coef_, bundle.estimator.coef_)


def test_errors_are_checkpoint_errors() -> None:
    assert issubclass(UntrustedTypesError, taskpoint.CheckpointError)
    assert issubclass(BundleFormatError, taskpoint.CheckpointFormatError)


def test_public_names_are_complete() -> None:
    exported = set(taskpoint_sklearn.__all__)
    for module in ("bundle", "checkpoint", "errors", "estimator", "formats"):
        names = importlib.import_module(f"taskpoint_sklearn.{module}").__all__
        public = {
            n for n in names
            if n not in {"decode", "encode", "filename_for", "type_names", "check_trusted"}
        }
        assert public <= exported, f"{module}: {public - exported} not re-exported"
    for name in exported:
        assert hasattr(taskpoint_sklearn, name)


def test_every_framework_installed_is_in_its_supported_range() -> None:
    assert set(taskpoint_sklearn.SUPPORTED_VERSIONS) == {"scikit-learn", "skops", "numpy"}
    for dist, spec in taskpoint_sklearn.SUPPORTED_VERSIONS.items():
        taskpoint.require_version(f"{dist}{spec}", adapter="taskpoint-sklearn")

"""Restores run no code from the store: untrusted types and pickles are refused."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import taskpoint
from sklearn.linear_model import SGDClassifier
from taskpoint_sklearn import (
    BundleFormatError,
    PartialFitBundle,
    TaskpointSklearnCheckpoint,
    UntrustedTypesError,
)

# What is refused is decided from the committed file's bytes, the same on every store: the
# file store and one object store are enough.
pytestmark = pytest.mark.stores("file", "s3")


def _trained_bundle() -> PartialFitBundle:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3))
    bundle = PartialFitBundle(SGDClassifier(random_state=0), 1, rng, {"note": "ok"})
    bundle.partial_fit(x, (x[:, 0] > 0).astype(int), classes=[0, 1])
    return bundle


def _committed_file(store_url: str) -> Path:
    path = taskpoint.Checkpoint(store_url).load_sync()
    assert path is not None and path.is_file()
    return path


def _rewrite_schema(data: bytes, edit: Any) -> bytes:
    """``data``, a skops zip, with its schema.json passed through ``edit``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            content = src.read(item.filename)
            if item.filename == "schema.json":
                schema = json.loads(content)
                edit(schema)
                content = json.dumps(schema).encode()
            dst.writestr(item, content)
    return out.getvalue()


def _commit_as_attacker(store_url: str, tmp_path: Path, name: str, data: bytes) -> None:
    """Someone with write access to the store commits ``data`` as the newest checkpoint."""
    evil_dir = tmp_path / "attacker"
    evil_dir.mkdir(exist_ok=True)
    (evil_dir / name).write_bytes(data)
    taskpoint.Checkpoint(store_url).save_sync(evil_dir / name)


def _swap_estimator_class(module: str) -> Any:
    def edit(schema: dict[str, Any]) -> None:
        node = schema["content"]["estimator"]
        assert node["__class__"] == "SGDClassifier"
        node["__module__"], node["__class__"] = module, "Evil"

    return edit


def _inject_function(schema: dict[str, Any]) -> None:
    metadata = schema["content"]["metadata"]
    metadata["content"]["hook"] = {
        "__class__": "system", "__module__": os.system.__module__,
        "__loader__": "TypeNode", "__id__": 1,
    }
    key_type = {"__class__": "str", "__module__": "builtins", "__loader__": "TypeNode", "__id__": 2}
    metadata["key_types"]["content"].append(key_type)


@pytest.mark.parametrize("fmt", ["skops", "pickle"])
def test_tampered_estimator_type_is_refused_and_named(
    fmt: str, evil_module: ModuleType, store_url: str, tmp_path: Path
) -> None:
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url), format=fmt)  # type: ignore[arg-type]
    TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url)).save_sync(_trained_bundle())
    assert ckpt.load_sync() is not None  # the untampered bundle loads
    legit = _committed_file(store_url)
    evil_type = f"{evil_module.__name__}.Evil"
    tampered = _rewrite_schema(legit.read_bytes(), _swap_estimator_class(evil_module.__name__))
    _commit_as_attacker(store_url, tmp_path, legit.name, tampered)

    with pytest.raises(UntrustedTypesError) as info:
        ckpt.load_sync()
    with pytest.raises(UntrustedTypesError):
        ckpt.resume_sync(SGDClassifier())

    assert info.value.types == [evil_type]
    assert evil_type in str(info.value)
    assert isinstance(info.value, taskpoint.CheckpointError)
    assert not evil_module.MARKER.exists()


def test_trusting_the_tampered_type_would_run_its_code(
    evil_module: ModuleType, store_url: str, tmp_path: Path
) -> None:
    """Control for the test above: the tampered file is a working exploit, so its refusal
    is what kept the code from running."""
    TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url)).save_sync(_trained_bundle())
    legit = _committed_file(store_url)
    tampered = _rewrite_schema(legit.read_bytes(), _swap_estimator_class(evil_module.__name__))
    _commit_as_attacker(store_url, tmp_path, legit.name, tampered)
    reckless = TaskpointSklearnCheckpoint(
        taskpoint.Checkpoint(store_url), trusted=[evil_module.Evil]
    )

    with pytest.raises(BundleFormatError, match="no partial_fit"):
        reckless.load_sync()

    assert evil_module.MARKER.exists()


def test_injected_function_reference_is_refused_and_named(
    store_url: str, tmp_path: Path
) -> None:
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url))
    ckpt.save_sync(_trained_bundle())
    legit = _committed_file(store_url)
    _commit_as_attacker(
        store_url, tmp_path, legit.name, _rewrite_schema(legit.read_bytes(), _inject_function)
    )

    with pytest.raises(UntrustedTypesError, match=re.escape(f"{os.system.__module__}.system")):
        ckpt.load_sync()


@pytest.mark.parametrize("name", ["sklearn-bundle.pkl", "sklearn-bundle.skops", "bundle.joblib"])
def test_pickle_checkpoint_is_not_unpickled_without_opt_in(
    name: str, evil_module: ModuleType, store_url: str, tmp_path: Path
) -> None:
    _commit_as_attacker(store_url, tmp_path, name, pickle.dumps(evil_module.Evil()))

    with pytest.raises(BundleFormatError, match="not a skops bundle") as info:
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url)).load_sync()

    assert "format='pickle'" in str(info.value)
    assert not evil_module.MARKER.exists()


def test_pickle_opt_in_does_unpickle(
    evil_module: ModuleType, store_url: str, tmp_path: Path
) -> None:
    """Control for the test above: the same file runs its code once pickle is opted into."""
    _commit_as_attacker(store_url, tmp_path, "x.pkl", pickle.dumps(evil_module.Evil()))

    with pytest.raises(BundleFormatError, match="not a taskpoint_sklearn bundle"):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url), format="pickle").load_sync()

    assert evil_module.MARKER.exists()


@pytest.mark.parametrize("fmt", ["skops", "pickle", "joblib"])
def test_each_format_round_trips(fmt: str, store_url: str) -> None:
    ckpt = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url), format=fmt)  # type: ignore[arg-type]
    bundle = _trained_bundle()
    ckpt.save_sync(bundle)

    restored = ckpt.load_sync()

    suffix = {"skops": ".skops", "pickle": ".pkl", "joblib": ".joblib"}[fmt]
    assert _committed_file(store_url).name == "sklearn-bundle" + suffix
    assert restored is not None
    assert np.array_equal(restored.estimator.coef_, bundle.estimator.coef_)
    assert restored.rng is not None and bundle.rng is not None
    assert restored.rng.bit_generator.state == bundle.rng.bit_generator.state
    assert restored.metadata == {"note": "ok"} and restored.progress == 1


def test_untrusted_metadata_is_refused_at_save_unless_trusted(
    evil_module: ModuleType, store_url: str
) -> None:
    bundle = _trained_bundle()
    bundle.metadata["note"] = evil_module.Note("mine")
    note_type = f"{evil_module.__name__}.Note"

    with pytest.raises(UntrustedTypesError, match=re.escape(note_type)):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url)).save_sync(bundle)
    assert taskpoint.Checkpoint(store_url).load_sync() is None  # nothing was committed

    trusting = TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url), trusted=[note_type])
    trusting.save_sync(bundle)
    restored = trusting.load_sync()
    assert restored is not None and restored.metadata["note"].text == "mine"
    with pytest.raises(UntrustedTypesError, match=re.escape(note_type)):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint(store_url)).load_sync()


def test_mlp_optimizers_are_the_only_extra_trusted_types() -> None:
    from taskpoint_sklearn import DEFAULT_TRUSTED_TYPES

    assert {
        "sklearn.neural_network._stochastic_optimizers.AdamOptimizer",
        "sklearn.neural_network._stochastic_optimizers.SGDOptimizer",
    } == DEFAULT_TRUSTED_TYPES


def test_trusted_must_be_a_list_of_types_or_names() -> None:
    with pytest.raises(TypeError, match="single string"):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint("memory://x"), trusted="mypkg.T")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected type names"):
        TaskpointSklearnCheckpoint(taskpoint.Checkpoint("memory://x"), trusted=[3])  # type: ignore[list-item]

"""taskpoint_sklearn: resumable scikit-learn ``partial_fit`` training, in a safe format.

A :class:`PartialFitBundle` holds the estimator (or a ``Pipeline`` ending in one with
``partial_fit``), a progress counter, the ``numpy.random.Generator`` the loop draws from
and your metadata. :class:`TaskpointSklearnCheckpoint` saves it after each chunk and
restores it on the next attempt, so the loop continues from the next chunk and ends
exactly where a run that never failed would::

    import numpy as np
    import taskpoint
    from sklearn.linear_model import SGDClassifier
    from taskpoint_sklearn import TaskpointSklearnCheckpoint

    env = taskpoint.TaskEnvironment(name="sk")

    @env.task(retries=3)
    async def incremental_sgd(chunks: int = 10) -> float:
        ckpt = TaskpointSklearnCheckpoint(taskpoint.ctx().checkpoint)
        bundle = await ckpt.resume(
            SGDClassifier(max_iter=1, tol=None, random_state=0),
            rng=np.random.default_rng(0),
        )
        for i in range(bundle.progress, chunks):
            x = bundle.rng.standard_normal((32, 8))
            y = (x[:, 0] + x[:, 1] > 0).astype(int)
            bundle.partial_fit(x, y, classes=[0, 1])
            bundle.progress = i + 1
            await ckpt.save(bundle)
        return float(bundle.estimator.coef_.sum())

Each ``save``/``save_sync`` is a chunk boundary: inside a taskpoint task a SIGTERM during a
chunk is noted, the save after that chunk is made as the preemption save, and
:class:`taskpoint.Preempted` ends the attempt once it committed; the next attempt resumes
with the next chunk. ``save_sync(bundle, every=N)`` saves every N chunks yet stops at the
next one.

Bundles are skops files by default, restored with an explicit list of trusted types
(skops' defaults, :data:`DEFAULT_TRUSTED_TYPES` and your ``trusted=``), so a restore runs
no code from the store; a bundle naming another type is refused with
:class:`UntrustedTypesError`. ``format="pickle"`` or ``"joblib"`` is an explicit opt-in.
"""

from taskpoint import require_version

SUPPORTED_VERSIONS: dict[str, str] = {
    "scikit-learn": ">=1.4,<2.0",
    "skops": ">=0.10,<1.0",
    "numpy": ">=1.26,<3.0",
}
"""Distribution name -> the range this adapter supports (PEP 440 specifier); importing
the package raises ``ImportError`` when one is outside it."""

for _dist, _spec in SUPPORTED_VERSIONS.items():
    require_version(f"{_dist}{_spec}", adapter="taskpoint-sklearn")

from taskpoint_sklearn.bundle import BIT_GENERATORS, BUNDLE_VERSION, PartialFitBundle  # noqa: E402
from taskpoint_sklearn.checkpoint import TaskpointSklearnCheckpoint  # noqa: E402
from taskpoint_sklearn.errors import BundleFormatError, UntrustedTypesError  # noqa: E402
from taskpoint_sklearn.estimator import (  # noqa: E402
    check_partial_fit,
    partial_fit,
    supports_partial_fit,
)
from taskpoint_sklearn.formats import DEFAULT_TRUSTED_TYPES, FORMATS, Format  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BIT_GENERATORS",
    "BUNDLE_VERSION",
    "DEFAULT_TRUSTED_TYPES",
    "FORMATS",
    "SUPPORTED_VERSIONS",
    "BundleFormatError",
    "Format",
    "PartialFitBundle",
    "TaskpointSklearnCheckpoint",
    "UntrustedTypesError",
    "__version__",
    "check_partial_fit",
    "partial_fit",
    "supports_partial_fit",
]

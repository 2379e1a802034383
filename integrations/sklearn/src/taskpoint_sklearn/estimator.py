"""Which estimators train incrementally, and one ``partial_fit`` step that also covers
``Pipeline``s.

Example::

    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.linear_model import SGDClassifier
    from taskpoint_sklearn import partial_fit

    pipe = make_pipeline(StandardScaler(), SGDClassifier(random_state=0))
    for x, y in chunks:
        partial_fit(pipe, x, y, classes=[0, 1])   # scaler.partial_fit, then clf.partial_fit
"""

from __future__ import annotations

from typing import Any

from sklearn.exceptions import NotFittedError
from sklearn.pipeline import Pipeline
from sklearn.utils.validation import check_is_fitted

__all__ = ["check_partial_fit", "partial_fit", "supports_partial_fit"]


def supports_partial_fit(estimator: object) -> bool:
    """Whether ``estimator`` can be trained chunk by chunk.

    True for an estimator with a ``partial_fit`` method (``MLPClassifier`` only with the
    ``"sgd"`` or ``"adam"`` solver) and for a ``Pipeline`` whose last step has one.
    """
    if isinstance(estimator, Pipeline):
        if not estimator.steps:
            return False
        return supports_partial_fit(estimator.steps[-1][1])
    return callable(getattr(estimator, "partial_fit", None))


def check_partial_fit(estimator: object) -> None:
    """Raise a ``TypeError`` explaining why ``estimator`` cannot be trained incrementally.

    Raises:
        TypeError: ``estimator`` has no ``partial_fit``, or is a ``Pipeline`` whose last
            step has none.
    """
    if supports_partial_fit(estimator):
        return
    hint = (
        "taskpoint_sklearn checkpoints incremental training only: use an estimator with "
        "partial_fit (SGDClassifier, SGDRegressor, MiniBatchKMeans, IncrementalPCA, "
        "MultinomialNB, MLPClassifier with solver 'adam' or 'sgd', ...), or a Pipeline "
        "ending in one"
    )
    if isinstance(estimator, Pipeline):
        if not estimator.steps:
            raise TypeError(f"the Pipeline has no steps; {hint}")
        name, step = estimator.steps[-1]
        raise TypeError(
            f"the Pipeline's last step {name!r} ({type(step).__name__}) has no "
            f"partial_fit; {hint}"
        )
    raise TypeError(f"{type(estimator).__name__} has no partial_fit; {hint}")


def partial_fit(estimator: Any, X: Any, y: Any = None, **params: Any) -> Any:
    """Train ``estimator`` on one chunk; a ``Pipeline`` is trained step by step.

    For a ``Pipeline``, each step before the last is updated with its own
    ``partial_fit(Xt, y)`` when it has one (``StandardScaler``, ``IncrementalPCA``, ...),
    must already be fitted (or need no fitting, like ``FunctionTransformer``) when it has
    none, and then transforms the chunk for the next step; ``"passthrough"`` steps are
    skipped. The last step gets ``partial_fit(Xt, y, **params)``.

    Args:
        estimator: an estimator with ``partial_fit``, or a ``Pipeline`` ending in one.
        X: the chunk's samples.
        y: the chunk's targets; ``None`` for unsupervised estimators.
        **params: passed to the (last step's) ``partial_fit``, e.g. ``classes=``.

    Returns:
        ``estimator``, updated in place.

    Raises:
        TypeError: ``estimator`` cannot be trained incrementally.
        ValueError: a Pipeline step without ``partial_fit`` is not fitted.
    """
    check_partial_fit(estimator)
    if not isinstance(estimator, Pipeline):
        estimator.partial_fit(X, y, **params)
        return estimator
    Xt = X
    for name, step in estimator.steps[:-1]:
        if step is None or (isinstance(step, str) and step == "passthrough"):
            continue
        if callable(getattr(step, "partial_fit", None)):
            step.partial_fit(Xt, y)
        else:
            try:
                check_is_fitted(step)
            except NotFittedError as exc:
                raise ValueError(
                    f"Pipeline step {name!r} ({type(step).__name__}) has no partial_fit and "
                    "is not fitted: fit it before the training loop, or use a step that "
                    "learns incrementally"
                ) from exc
        Xt = step.transform(Xt)
    estimator.steps[-1][1].partial_fit(Xt, y, **params)
    return estimator

"""``PartialFitBundle``: everything an incremental training loop needs to resume.

Example::

    import numpy as np
    from sklearn.linear_model import SGDClassifier
    from taskpoint_sklearn import PartialFitBundle

    bundle = PartialFitBundle(SGDClassifier(random_state=0), rng=np.random.default_rng(0))
    for i in range(bundle.progress, 10):
        x = bundle.rng.standard_normal((32, 8))     # draw from the bundle's generator
        bundle.partial_fit(x, x[:, 0] > 0, classes=[False, True])
        bundle.progress = i + 1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from taskpoint_sklearn.errors import BundleFormatError
from taskpoint_sklearn.estimator import check_partial_fit, partial_fit

__all__ = ["BIT_GENERATORS", "BUNDLE_VERSION", "PartialFitBundle"]

BUNDLE_VERSION = 1
"""The layout version written into every saved bundle."""

BIT_GENERATORS = frozenset({"MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64"})
"""The ``numpy.random`` bit generators a bundle's RNG may use."""


def _check_progress(progress: object) -> int:
    if isinstance(progress, bool) or not isinstance(progress, (int, np.integer)) or progress < 0:
        raise ValueError(f"progress must be a non-negative int; got {progress!r}")
    return int(progress)


def _check_rng(rng: object) -> np.random.Generator | None:
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(
            "rng must be a numpy.random.Generator (np.random.default_rng(seed)) or None; "
            f"got {type(rng).__name__}"
        )
    return rng


@dataclass
class PartialFitBundle:
    """An estimator trained with ``partial_fit``, with its loop's progress and RNG.

    Attributes:
        estimator: an estimator with ``partial_fit``, or a ``Pipeline`` ending in one.
        progress: how much work is done, in the loop's own unit (chunks or samples);
            a resumed loop starts from here. Set it after each chunk, before saving.
        rng: the ``numpy.random.Generator`` the loop draws chunks (or shuffles) from, or
            ``None``. Its bit generator's state is saved, so a resumed loop draws exactly
            the numbers an uninterrupted one would have. Always draw from
            ``bundle.rng``: after a restore it is a new object.
        metadata: your own values (str keys); saved and restored as they are. With the
            skops format, types outside the trusted list must be passed as ``trusted``.

    Raises:
        TypeError: the estimator has no ``partial_fit``, ``rng`` is not a
            ``numpy.random.Generator`` or ``metadata`` is not a mapping.
        ValueError: ``progress`` is negative or not an int.
    """

    estimator: Any
    progress: int = 0
    rng: np.random.Generator | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_partial_fit(self.estimator)
        self.progress = _check_progress(self.progress)
        _check_rng(self.rng)
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"metadata must be a mapping; got {type(self.metadata).__name__}")
        self.metadata = dict(self.metadata)

    def partial_fit(self, X: Any, y: Any = None, **params: Any) -> Any:
        """Train the estimator on one chunk; see :func:`taskpoint_sklearn.partial_fit`.

        ``progress`` is left to you: set it once the chunk is done.
        """
        return partial_fit(self.estimator, X, y, **params)

    def to_payload(self) -> dict[str, Any]:
        """The plain dictionary that is serialised: estimator, progress, RNG state, metadata.

        Raises:
            TypeError, ValueError: a field was set to an unsupported value since construction.
        """
        check_partial_fit(self.estimator)
        rng = _check_rng(self.rng)
        rng_state = None if rng is None else rng.bit_generator.state
        if rng_state is not None and rng_state.get("bit_generator") not in BIT_GENERATORS:
            raise TypeError(
                f"rng uses bit generator {rng_state.get('bit_generator')!r}; supported: "
                f"{sorted(BIT_GENERATORS)}"
            )
        return {
            "taskpoint_sklearn": BUNDLE_VERSION,
            "estimator": self.estimator,
            "progress": _check_progress(self.progress),
            "rng_state": rng_state,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_payload(cls, payload: object, *, source: str) -> PartialFitBundle:
        """Rebuild a bundle from a deserialised payload, checking every field.

        Args:
            payload: what :meth:`to_payload` produced, after a round trip.
            source: where it came from, for error messages.

        Raises:
            BundleFormatError: a field is missing or of the wrong kind.
        """
        if not isinstance(payload, dict) or "taskpoint_sklearn" not in payload:
            raise BundleFormatError(
                f"{source} is not a taskpoint_sklearn bundle (got {type(payload).__name__} "
                "without the 'taskpoint_sklearn' field)",
                path=source,
            )
        version = payload["taskpoint_sklearn"]
        if version != BUNDLE_VERSION:
            raise BundleFormatError(
                f"{source} is a taskpoint_sklearn bundle of layout {version!r}; this version "
                f"reads layout {BUNDLE_VERSION}: upgrade taskpoint-sklearn",
                path=source,
            )
        try:
            return cls(
                estimator=payload["estimator"],
                progress=payload["progress"],
                rng=_generator_from_state(payload["rng_state"]),
                metadata=payload["metadata"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleFormatError(f"{source} holds an invalid bundle: {exc}", path=source) from exc


def _generator_from_state(state: object) -> np.random.Generator | None:
    if state is None:
        return None
    if not isinstance(state, dict) or state.get("bit_generator") not in BIT_GENERATORS:
        raise ValueError(
            f"rng_state must be None or a numpy bit generator state naming one of "
            f"{sorted(BIT_GENERATORS)}; got {state!r:.200}"
        )
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)

"""Bundle formats: skops (default, restores without running code from the file) and,
only on explicit opt-in, pickle and joblib.

A skops bundle is restored in two steps: :func:`skops.io.get_untrusted_types` lists the
types in the file that skops does not trust on its own; every one of them must be in
the allowed list (:data:`DEFAULT_TRUSTED_TYPES` plus what the user passes), or the
restore is refused with :class:`~taskpoint_sklearn.UntrustedTypesError` naming them
before anything is constructed. Only then is the file loaded, with exactly those types
passed to :func:`skops.io.loads` as ``trusted``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, get_args

from taskpoint_sklearn.errors import BundleFormatError, UntrustedTypesError

__all__ = [
    "DEFAULT_TRUSTED_TYPES",
    "FORMATS",
    "Format",
    "decode",
    "encode",
    "filename_for",
    "type_names",
]

Format = Literal["skops", "pickle", "joblib"]
"""A bundle format name."""
FORMATS: tuple[str, ...] = get_args(Format)
"""The accepted format names, the safe default first."""

_SUFFIX = {"skops": ".skops", "pickle": ".pkl", "joblib": ".joblib"}
_ZIP_MAGIC = b"PK\x03\x04"

DEFAULT_TRUSTED_TYPES: frozenset[str] = frozenset(
    {
        # MLPClassifier / MLPRegressor keep their solver's state between partial_fit calls.
        "sklearn.neural_network._stochastic_optimizers.AdamOptimizer",
        "sklearn.neural_network._stochastic_optimizers.SGDOptimizer",
    }
)
"""Types trusted beyond skops' own defaults: what the tested estimators
(``SGDClassifier``, ``SGDRegressor``, ``MiniBatchKMeans``, ``IncrementalPCA``,
``MultinomialNB``, ``MLPClassifier``) and ``Pipeline``s of scikit-learn estimators need.
skops itself trusts scikit-learn's public estimators, NumPy arrays and RNGs and
Python's primitives and containers."""


def type_names(trusted: Iterable[str | type]) -> frozenset[str]:
    """Fully qualified names (``"module.Class"``) of the given types or names.

    Raises:
        TypeError: ``trusted`` is a single string, or holds something that is neither a
            type nor a string.
    """
    if isinstance(trusted, (str, bytes)):
        raise TypeError(
            f"trusted must be a list of type names or types, not a single string; got {trusted!r}"
        )
    names: set[str] = set()
    for item in trusted:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type):
            names.add(f"{item.__module__}.{item.__name__}")  # as skops names types
        else:
            raise TypeError(
                f"trusted holds {item!r} ({type(item).__name__}); expected type names like "
                "'mypkg.MyTransformer' or the types themselves"
            )
    return frozenset(names)


def filename_for(fmt: Format, stem: str) -> str:
    """The bundle's file name in the checkpoint for format ``fmt``."""
    return stem + _SUFFIX[fmt]


def _refused_message(refused: Iterable[str], where: str, saving: bool) -> str:
    names = sorted(refused)
    fix = (
        f"If you trust every one of them, pass TaskpointSklearnCheckpoint(..., trusted={names!r})"
    )
    if saving:
        return (
            f"{where} holds types that a restore would refuse: {names}. Nothing was saved. "
            f"{fix} (to the checkpoint that saves and the one that restores), or keep such "
            "objects out of the bundle"
        )
    return (
        f"{where} holds types that are not trusted: {names}. Nothing was loaded from it. "
        f"{fix}; otherwise the checkpoint may have been tampered with"
    )


def check_trusted(
    data: bytes, allowed: frozenset[str], *, where: str, saving: bool = False
) -> list[str]:
    """The skops-untrusted types in ``data``, once all of them are in ``allowed``.

    Raises:
        UntrustedTypesError: a type outside ``allowed`` is present; named in the message.
        BundleFormatError: ``data`` is not a readable skops file.
    """
    import skops.io as sio

    try:
        untrusted = sio.get_untrusted_types(data=data)
    except Exception as exc:
        raise BundleFormatError(f"{where} is not a readable skops file: {exc}", path=where) from exc
    refused = sorted(set(untrusted) - allowed)
    if refused:
        raise UntrustedTypesError(
            _refused_message(refused, where, saving), types=refused, path=where
        )
    return sorted(untrusted)


def encode(payload: dict[str, Any], fmt: Format, allowed: frozenset[str]) -> bytes:
    """Serialise a bundle payload in ``fmt``.

    A skops payload is checked against ``allowed`` straight away, so a bundle that a
    restore would refuse is never saved.

    Raises:
        TypeError: skops cannot represent an object in the payload.
        UntrustedTypesError: the payload holds a type outside ``allowed``.
    """
    if fmt == "skops":
        import skops.io as sio

        try:
            data: bytes = sio.dumps(payload)
        except TypeError as exc:
            raise TypeError(
                f"the bundle cannot be saved in the skops format: {exc}. Keep metadata to "
                "str/int/float/bool, lists, dicts and NumPy arrays, or opt into "
                "format='pickle' if you trust the store"
            ) from exc
        check_trusted(data, allowed, where="the bundle being saved", saving=True)
        return data
    if fmt == "pickle":
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    import joblib

    buffer = io.BytesIO()
    joblib.dump(payload, buffer)
    return buffer.getvalue()


def decode(path: Path, fmt: Format, allowed: frozenset[str]) -> Any:
    """Read a bundle payload from ``path``, safely unless pickle was opted into.

    A skops file (recognised by its content, whatever ``fmt``) is always loaded through
    the trusted-types check. Any other file is unpickled only when ``fmt`` is
    ``"pickle"`` or ``"joblib"``.

    Raises:
        UntrustedTypesError: the skops file holds a type outside ``allowed``.
        BundleFormatError: the file is unreadable, or is not skops and pickle was not
            opted into.
    """
    where = str(path)
    data = path.read_bytes()
    if data.startswith(_ZIP_MAGIC):
        trusted = check_trusted(data, allowed, where=where)
        import skops.io as sio

        try:
            return sio.loads(data, trusted=trusted)
        except Exception as exc:
            raise BundleFormatError(f"cannot load skops bundle {where}: {exc}", path=where) from exc
    if fmt == "skops":
        raise BundleFormatError(
            f"{where} is not a skops bundle (a pickle or joblib file, or something else). "
            "Unpickling runs code from the file, so it is not loaded; pass "
            "format='pickle' or format='joblib' only if you trust everyone who can write "
            "to the checkpoint store",
            path=where,
        )
    try:
        if path.suffix == ".joblib" or fmt == "joblib":
            import joblib

            return joblib.load(path)
        return pickle.loads(data)
    except Exception as exc:
        raise BundleFormatError(f"cannot unpickle bundle {where}: {exc}", path=where) from exc

"""The exceptions taskpoint_sklearn raises, under taskpoint's own tree::

    taskpoint.CheckpointError
    ├── UntrustedTypesError           a skops bundle names types outside the trusted list
    └── taskpoint.CheckpointFormatError
        └── BundleFormatError         the checkpoint is not a bundle this loader will read

Bad arguments (an estimator without ``partial_fit``, an unknown format) raise ``TypeError``
or ``ValueError``, as in taskpoint's core.
"""

from __future__ import annotations

from collections.abc import Iterable

from taskpoint import CheckpointError, CheckpointFormatError

__all__ = ["BundleFormatError", "UntrustedTypesError"]


class UntrustedTypesError(CheckpointError):
    """A skops bundle holds types that are not trusted; nothing in it was constructed.

    Attributes:
        types: the fully qualified names of the refused types, sorted.
        path: the local file that was refused (on save: a description of the bundle).
    """

    def __init__(self, message: str, *, types: Iterable[str], path: str) -> None:
        super().__init__(message)
        self.types = sorted(types)
        self.path = path


class BundleFormatError(CheckpointFormatError):
    """The restored checkpoint is not a bundle this loader reads: a pickle or joblib file
    when pickle was not opted into, a directory, or a file without the bundle's fields.

    Attributes:
        path: the local file or directory that was refused.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path

"""The errors the PyTorch adapter raises, all under :class:`taskpoint.CheckpointError`::

    CheckpointError
    └── StateError                 a state bundle could not be saved or restored
        ├── StateLayoutError       the checkpoint is not a bundle of this layout
        └── StateMismatchError     the bundle does not fit the objects restored into

Bad arguments raise ``TypeError``/``ValueError``, as in the core package.
"""

from __future__ import annotations

from taskpoint import CheckpointError

__all__ = ["StateError", "StateLayoutError", "StateMismatchError"]


class StateError(CheckpointError):
    """A :class:`~taskpoint_pytorch.TaskpointState` could not be saved or restored
    (for one, another rank of a distributed job failed, so this one stops too)."""


class StateLayoutError(StateError):
    """The checkpoint is not a state bundle this version reads: a file that
    ``TaskpointState`` did not write, a newer layout version, or a bundle holding other
    components (models, optimizers, ...) than the state restoring it."""


class StateMismatchError(StateError):
    """The bundle's contents do not fit the objects being restored.

    Attributes:
        component: which object failed, e.g. ``"models['model']"``.
        missing: keys the object has but the checkpoint lacks.
        unexpected: keys the checkpoint has but the object lacks.
        shapes: ``{key: (saved shape, current shape)}`` for tensors whose shapes differ.
    """

    def __init__(
        self,
        message: str,
        *,
        component: str,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        super().__init__(message)
        self.component = component
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.shapes = dict(shapes or {})

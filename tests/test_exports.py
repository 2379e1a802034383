"""The public API is exactly what ``taskpoint.__all__`` lists."""

from __future__ import annotations

import taskpoint


def test_all_names_exist_and_public_names_are_listed() -> None:
    for name in taskpoint.__all__:
        assert hasattr(taskpoint, name), name
    public = {
        name
        for name, value in vars(taskpoint).items()
        if not name.startswith("_") and not isinstance(value, type(taskpoint))
    }
    assert public == set(taskpoint.__all__) - {"__version__"}


def test_errors_form_one_hierarchy() -> None:
    for name in ("CheckpointStoreError", "CheckpointCorruptError", "CheckpointUnsafeError",
                 "CheckpointFormatError"):
        assert issubclass(getattr(taskpoint, name), taskpoint.CheckpointError)


def test_checkpoint_satisfies_the_protocol() -> None:
    assert isinstance(taskpoint.Checkpoint("memory://p"), taskpoint.CheckpointLike)

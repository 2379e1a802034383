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


def test_the_adapter_api_lists_exactly_what_it_holds() -> None:
    """``taskpoint.integration`` (what adapter authors get) re-exports each name in its
    ``__all__`` from the module defining it, documented there, and holds nothing else."""
    import inspect

    import taskpoint.integration as api

    public = {name for name in vars(api) if not name.startswith("_")}
    assert public == set(api.__all__)
    assert len(api.__all__) == len(set(api.__all__))
    assert api.__all__ == sorted(api.__all__, key=lambda n: (not n[0].isupper(), n))
    for name in api.__all__:
        value = getattr(api, name)
        assert value.__module__ != api.__name__, f"{name} is defined in the face itself"
        assert inspect.getdoc(value), f"{name} has no docstring at its definition"

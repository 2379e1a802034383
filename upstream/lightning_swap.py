"""Run Lightning's own ``ModelCheckpoint`` tests against ``TaskpointModelCheckpoint``.

Every ``ModelCheckpoint`` the upstream tests make (and the one the ``Trainer`` adds by
default) becomes a ``TaskpointModelCheckpoint`` bound to a fresh ``file://`` store, so the
tests check that the taskpoint callback keeps ``ModelCheckpoint``'s behaviour::

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    .venv/bin/python upstream/lightning_swap.py --upstream /tmp/pl -- -q -x

The upstream tests import a few packages the project does not install
(``jsonargparse[signatures]``, ``omegaconf``, ``tensorboardX``); give a folder holding
them with ``--extra-path`` (``uv pip install --target DIR ...``), searched after the
project's own packages. Arguments after ``--``
go to pytest. Exits with pytest's status.

The swap happens on import, as ``lightning_swap``; the workers ``ddp_spawn`` starts re-run
this file first, so they swap the class too before they unpickle the parent's callbacks.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import itertools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_FILES = (
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
)
"""The upstream test files, relative to the checkout's ``tests`` folder."""

_STORES_ENV = "TASKPOINT_SWAP_STORES"
"""The folder the stores are made under, shared with spawned workers."""
_MODULES = (
    "lightning.pytorch.callbacks",
    "lightning.pytorch.callbacks.model_checkpoint",
    "lightning.pytorch.trainer.connectors.callback_connector",
)
"""Where the swapped class replaces ``ModelCheckpoint``: what tests import, and the
module that makes the ``Trainer``'s default callback."""

_counter = itertools.count()


def _stores_root() -> Path:
    root = os.environ.get(_STORES_ENV)
    if root is None:
        root = tempfile.mkdtemp(prefix="taskpoint-swap-stores-")
        os.environ[_STORES_ENV] = root
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    return Path(root)


def _start_upload_process(store: Path) -> None:
    """Make one background save, which starts the job's upload process before any test.

    The process's reply thread (``taskpoint-upload-process``) then lives until the
    interpreter exits, as fsspec's ``fsspecIO`` thread does. Lightning's conftest fails a
    test that leaves a new thread behind; started here, the thread is not new to any test.
    """
    import taskpoint

    with taskpoint.Checkpoint(store.as_uri()) as checkpoint:
        checkpoint.save_sync(b"starts the upload process", background=True)


def _make_swap() -> type:
    import taskpoint
    from lightning.pytorch.callbacks import model_checkpoint
    from taskpoint_lightning import TaskpointModelCheckpoint

    original = model_checkpoint.ModelCheckpoint
    if issubclass(original, TaskpointModelCheckpoint):
        return original  # already swapped in this process

    class ModelCheckpoint(TaskpointModelCheckpoint):
        """``TaskpointModelCheckpoint`` bound to a fresh store: ``ModelCheckpoint``'s
        arguments, and only those."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            store = _stores_root() / f"pid{os.getpid()}-{next(_counter)}"
            super().__init__(taskpoint.Checkpoint(store.as_uri()), *args, **kwargs)

    ModelCheckpoint.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    ModelCheckpoint.__qualname__ = "ModelCheckpoint"
    for name in _MODULES:
        sys.modules[name].ModelCheckpoint = ModelCheckpoint
    return ModelCheckpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, type=Path, help="a Lightning checkout")
    parser.add_argument(
        "--extra-path", type=Path, action="append", default=[],
        help="a folder of packages the upstream tests need (repeatable)",
    )
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES))
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args(argv)

    tests = (args.upstream / "tests").resolve()
    missing = [f for f in args.files if not (tests / f).is_file()]
    if missing:
        parser.error(f"{tests} has no {', '.join(missing)}: is --upstream a Lightning checkout?")
    here = str(Path(__file__).resolve().parent)
    # Spawned workers get this sys.path too, so they find this module and the tests. The
    # extra packages come last: none of them replaces one the project installed.
    sys.path[:0] = [here, str(tests)]
    sys.path.extend(str(p.resolve()) for p in args.extra_path)
    _start_upload_process(_stores_root() / "warm-up")
    import lightning_swap  # the importable copy of this module: swaps the class
    import pytest

    assert lightning_swap.ModelCheckpoint.__module__ == "lightning_swap"
    # No settings of the project's nor Lightning's: only what the tests need.
    ini = Path(os.environ[_STORES_ENV]) / "pytest.ini"
    ini.write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    tested = [str(tests / f) for f in args.files]
    return int(pytest.main([
        "-c", str(ini), "--rootdir", str(tests), "-p", "no:cacheprovider", *tested,
        *args.pytest_args,
    ]))

if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":  # a spawned worker re-running this file: swap there too
    import lightning_swap  # noqa: F401
else:  # imported as lightning_swap
    ModelCheckpoint = _make_swap()

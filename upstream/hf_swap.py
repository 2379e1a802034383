"""Run transformers' own Trainer tests with ``TaskpointTrainerCallback`` in every Trainer.

Usage::

    .venv/bin/python upstream/hf_swap.py --upstream ~/src/transformers            # with the swap
    .venv/bin/python upstream/hf_swap.py --upstream ~/src/transformers --no-swap  # as shipped
    .venv/bin/python upstream/hf_swap.py --upstream ~/src/transformers -- -k resume -x

``--upstream`` is a checkout of huggingface/transformers at the version installed here
(its ``tests/`` folder is used, never its ``src/``). The test files named by ``--files``
(by default the callback and checkpointing tests) are copied, with ``tests/trainer``'s
helpers and ``tests/fixtures``, into a temporary folder, beside a ``conftest.py`` that
adds ``TaskpointTrainerCallback`` to transformers' default callbacks: each Trainer made gets
one, saving to a fresh ``file://`` store of its own. pytest then
runs there on CPU (``CUDA_VISIBLE_DEVICES`` empty), outside this project's configuration.
Its exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_FILES = ("test_trainer_callback.py", "test_trainer_checkpointing.py")

CONFTEST = '''\
"""Written by taskpoint's upstream/hf_swap.py: every Trainer gets a TaskpointTrainerCallback."""

import atexit
import itertools
import shutil
import tempfile
from pathlib import Path

import transformers.trainer
from taskpoint import Checkpoint
from taskpoint_hf import TaskpointTrainerCallback as _Adapter

_STORES = Path(tempfile.mkdtemp(prefix="hf-swap-stores-"))
atexit.register(shutil.rmtree, _STORES, True)
_NUMBERS = itertools.count()


class TaskpointTrainerCallback(_Adapter):
    """The adapter's callback, saving to a fresh store of its own: made with no arguments,
    as the Trainer makes its default callbacks."""

    def __init__(self):
        store = _STORES / f"store-{next(_NUMBERS)}"
        super().__init__(Checkpoint(store.as_uri(), keep=3))


# One of the Trainer's default callbacks: every Trainer gets one, and the tests that list
# the default callbacks (they read this same list) expect it.
transformers.trainer.DEFAULT_CALLBACKS.append(TaskpointTrainerCallback)
'''


def _copy_tests(upstream: Path, into: Path, files: list[str]) -> list[Path]:
    """Copy ``files`` and the helpers they import into ``into``; their new paths."""
    source = upstream / "tests"
    trainer = source / "trainer"
    missing = [name for name in files if not (trainer / name).is_file()]
    if missing:
        raise SystemExit(f"{trainer} lacks {', '.join(missing)}: is --upstream a transformers checkout?")
    target = into / "tests" / "trainer"
    target.mkdir(parents=True)
    (into / "tests" / "__init__.py").touch()
    (target / "__init__.py").touch()
    for helper in trainer.glob("*.py"):
        if not helper.name.startswith("test_"):  # trainer_test_utils.py and the like
            shutil.copy2(helper, target / helper.name)
    if (source / "fixtures").is_dir():
        shutil.copytree(source / "fixtures", into / "tests" / "fixtures")
    for name in files:
        shutil.copy2(trainer / name, target / name)
    return [target / name for name in files]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, required=True, help="a transformers checkout")
    parser.add_argument(
        "--files", nargs="+", default=list(DEFAULT_FILES),
        help="test files under tests/trainer (default: %(default)s)",
    )
    parser.add_argument(
        "--no-swap", dest="swap", action="store_false", help="run them as shipped (a baseline)"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hf-swap-") as folder:
        root = Path(folder)
        tests = _copy_tests(options.upstream.resolve(), root, options.files)
        if options.swap:
            (root / "conftest.py").write_text(CONFTEST)
        (root / "pytest.ini").write_text("[pytest]\n")  # not this project's configuration
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
            "-c", str(root / "pytest.ini"), *map(str, tests), *options.pytest_args,
        ]
        return subprocess.call(command, cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main())

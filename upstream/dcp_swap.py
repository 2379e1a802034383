"""Run PyTorch's own DCP tests with taskpoint's storage classes in place of the file-system ones.

PyTorch tests ``torch.distributed.checkpoint`` against ``FileSystemWriter`` and
``FileSystemReader``; :class:`taskpoint_pytorch.TaskpointStorageWriter` and
:class:`taskpoint_pytorch.TaskpointStorageReader` claim to be drop-ins for them. This script
copies the chosen test files from a PyTorch checkout into a temporary folder, adds one line
at the top of each copy that calls :func:`install`, and runs them with pytest. ``install``
replaces ``FileSystemWriter``/``FileSystemReader`` wherever DCP and the tests look them up
(``torch.distributed.checkpoint``, its ``filesystem``, ``format_utils`` and storage-detection
modules), in the test process and in every rank process the test harness spawns (they import
the same copied file). Each checkpoint folder a test names becomes a taskpoint checkpoint
location (a ``file://`` store at that folder), so every save commits a taskpoint checkpoint
and every load restores the newest one.

Options that belong to the file-system writer alone (``sync_files``, ``single_file_per_rank``,
``overwrite``, ``cache_staged_state_dict``, ``_extensions``, ...) are accepted and ignored;
``thread_count`` is passed on. Tests of those options are deselected (see ``EXCLUDED``), as
are cases that need CUDA devices (the harness skips those itself on a CPU machine).

Usage (from the repository root, in the workspace's environment)::

    .venv/bin/python upstream/dcp_swap.py --upstream ~/src/pytorch
    .venv/bin/python upstream/dcp_swap.py --upstream ~/src/pytorch --baseline  # no swap

``--upstream`` is a PyTorch checkout (its ``test/distributed/checkpoint/``) or any folder
holding the test files. PyTorch's harness needs ``expecttest`` importable (``pip install
--target DIR expecttest`` and ``--extra-path DIR``). Run the tests of the PyTorch version
you have installed: a newer file may use planner options the installed torch lacks (run
with ``--baseline`` to see which fail without the swap). The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

FILES = (
    "test_file_system_checkpoint_cpu.py",
    "test_dtensor_resharding.py",
    "e2e/test_e2e_save_and_load.py",
    "test_format_utils.py",
    "test_dcp_to_torch_save.py",
)
"""The test files run, relative to ``test/distributed/checkpoint/``."""

EXCLUDED = {
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoadRot13":
        "FileSystemWriter's private _extensions option (a stream transform per file)",
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoadZStandard":
        "FileSystemWriter's private _extensions option (zstd per file)",
}
"""Node-id prefixes deselected under the swap, with the reason."""

_HEADER = "import dcp_swap as _dcp_swap; _dcp_swap.install()  # added by upstream/dcp_swap.py\n"
_INSTALLED = False


def install() -> None:
    """Replace DCP's file-system storage classes with taskpoint's, in this process.

    Idempotent. Imports torch and taskpoint_pytorch.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    import taskpoint
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint._storage_utils as storage_utils
    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.format_utils as format_utils
    from taskpoint_pytorch import TaskpointStorageReader, TaskpointStorageWriter

    fs_writer, fs_reader = filesystem.FileSystemWriter, filesystem.FileSystemReader

    class FileSystemWriter(TaskpointStorageWriter):
        """``FileSystemWriter(path, ...)`` that commits to a taskpoint checkpoint at ``path``."""

        def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
            super().__init__(
                taskpoint.Checkpoint(os.fspath(path)), thread_count=kwargs.get("thread_count", 1)
            )

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
            return bool(fs_writer.validate_checkpoint_id(checkpoint_id))

        def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
            if checkpoint_id is not None:  # DCP passes a new folder for an existing writer
                self._checkpoint = taskpoint.Checkpoint(os.fspath(checkpoint_id))
            super().reset(checkpoint_id)

    class FileSystemReader(TaskpointStorageReader):
        """``FileSystemReader(path, ...)`` that loads the taskpoint checkpoint at ``path``."""

        def __init__(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
            super().__init__(taskpoint.Checkpoint(os.fspath(path)))

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
            return bool(fs_reader.validate_checkpoint_id(checkpoint_id))

        def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
            if checkpoint_id is not None:
                self._checkpoint = taskpoint.Checkpoint(os.fspath(checkpoint_id))
            super().reset(checkpoint_id)

    for module in (dcp, filesystem, storage_utils, format_utils):
        module.FileSystemWriter = FileSystemWriter  # type: ignore[attr-defined,misc]
        module.FileSystemReader = FileSystemReader  # type: ignore[attr-defined,misc]
    _INSTALLED = True


def _find(upstream: Path, name: str) -> Path:
    """The test file ``name`` under a PyTorch checkout or a folder holding the files."""
    for candidate in (
        upstream / "test" / "distributed" / "checkpoint" / name,
        upstream / name,
        upstream / Path(name).name,
    ):
        if candidate.is_file():
            return candidate
    raise SystemExit(f"{name} not found under {upstream} (pass a PyTorch checkout as --upstream)")


def _copy(source: Path, target: Path, swap: bool) -> None:
    text = source.read_text()
    if swap:
        lines = text.splitlines(keepends=True)
        at = max((i + 1 for i, line in enumerate(lines) if line.startswith("from __future__")),
                 default=0)
        text = "".join([*lines[:at], _HEADER, *lines[at:]])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _counts(junit: Path) -> dict[str, dict[str, int]]:
    """Per test file: passed, failed (failures and errors) and skipped cases."""
    per_file: dict[str, dict[str, int]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("file") or case.get("classname", "?").rpartition(".")[0] + ".py"
        counts = per_file.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return per_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, required=True,
                        help="a PyTorch checkout, or a folder holding the test files")
    parser.add_argument("--baseline", action="store_true",
                        help="run the copies unchanged (PyTorch's own file-system classes)")
    parser.add_argument("--extra-path", action="append", default=[],
                        help="extra import folders for the tests (e.g. where expecttest is)")
    parser.add_argument("--keep", type=Path, help="copy the tests here and keep them")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)

    work = args.keep or Path(tempfile.mkdtemp(prefix="taskpoint-dcp-swap-"))
    try:
        tests = work / "tests"
        copies = []
        for name in FILES:
            target = tests / name
            _copy(_find(args.upstream.expanduser(), name), target, swap=not args.baseline)
            copies.append(str(target.relative_to(work)))
        deselect = [] if args.baseline else [
            arg for prefix in EXCLUDED for arg in ("--deselect", f"tests/{prefix}")
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent), *args.extra_path,
             *filter(None, [env.get("PYTHONPATH")])]
        )
        junit = work / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
               "--rootdir", str(work), f"--junitxml={junit}", *deselect, *copies,
               *args.pytest_args]
        rc = subprocess.call(cmd, cwd=work, env=env)
        if junit.is_file():
            print(f"\n{'baseline (FileSystemWriter/Reader)' if args.baseline else 'taskpoint swap'}:")
            for name, c in sorted(_counts(junit).items()):
                print(f"  {name}: {c['passed']} passed, {c['failed']} failed, "
                      f"{c['skipped']} skipped")
            if not args.baseline:
                for prefix, reason in EXCLUDED.items():
                    print(f"  deselected {prefix}: {reason}")
        return rc
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

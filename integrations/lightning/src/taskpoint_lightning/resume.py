"""``resume_ckpt_path``: the ``ckpt_path`` that ``Trainer.fit`` resumes from.

Example::

    ckpt = taskpoint.ctx().checkpoint
    trainer.fit(model, ckpt_path=resume_ckpt_path(ckpt, dirpath="ckpts"))   # None at first
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from taskpoint import CheckpointLike, latest_checkpoint
from taskpoint.mirror import settle_uploads

__all__ = ["resume_ckpt_path"]

log = logging.getLogger(__name__)

_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
_filled: set[str] = set()


def filled_by_resume(dirpath: str | os.PathLike[str]) -> bool:
    """Whether :func:`resume_ckpt_path` restored a tree into ``dirpath`` in this process."""
    return os.path.realpath(dirpath) in _filled


def _is_global_zero() -> bool:
    """Whether this process is global rank zero, before or after a process group exists."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    for name in _RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name]) == 0
    # Lightning's own launcher gives the processes it starts LOCAL_RANK and NODE_RANK.
    return all(int(os.environ.get(name, "0")) == 0 for name in ("LOCAL_RANK", "NODE_RANK"))


def _newest_ckpt(root: Path, pattern: str) -> Path | None:
    """The newest ``.ckpt`` under ``root`` matching ``pattern``: a file, or a folder (a
    sharded strategy's checkpoint, one file per rank), dated by its newest file."""
    if root.is_file():
        return latest_checkpoint(root, pattern)
    newest: tuple[int, str] | None = None
    found = None
    for path in root.glob(pattern):
        if path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file()]
            if not files:
                continue
            when = max(latest.stat().st_mtime_ns for latest in files)
        elif path.is_file():
            when = path.stat().st_mtime_ns
        else:
            continue
        if newest is None or (when, str(path)) > newest:
            newest, found = (when, str(path)), path
    return found


def _replace_tree(restored: Path, target: Path) -> Path:
    """Make ``target`` hold exactly the restored tree (files moved, times kept)."""
    target.mkdir(parents=True, exist_ok=True)
    for child in target.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    for child in restored.iterdir():
        shutil.move(os.fspath(child), os.fspath(target / child.name))
    return target


def resume_ckpt_path(
    checkpoint: CheckpointLike, dirpath: str | os.PathLike[str] | None = None
) -> str | None:
    """Restore the newest mirrored checkpoint folder; the file ``Trainer.fit`` resumes from.

    Args:
        checkpoint: the checkpoint given to
            :class:`~taskpoint_lightning.TaskpointModelCheckpoint`.
        dirpath: the callback's ``dirpath``. When given, global rank zero restores the
            tree into it, replacing what it holds, so Lightning's top-k bookkeeping finds
            its files and the next mirror keeps them; other ranks (which never write
            checkpoints) read a private restored copy. When ``None`` every process reads
            a private restored copy.

    Returns:
        The newest ``last*.ckpt`` of the restored tree, else its newest ``*.ckpt``
        (newest by modification time, which the store keeps; a sharded strategy's
        checkpoint is a folder, dated by its newest file); ``None`` when nothing was
        mirrored yet (the first attempt) or the mirror holds no ``.ckpt`` file.

    Mirrors this process still uploads (a failed attempt's, retried in the same process)
    are waited for first, so the newest one is found.

    Raises:
        taskpoint.CheckpointError: the store could not be read.
    """
    settle_uploads()
    restored = checkpoint.load_sync()
    if restored is None:
        return None
    root = restored
    if dirpath is not None and restored.is_dir() and _is_global_zero():
        root = _replace_tree(restored, Path(dirpath))
        _filled.add(os.path.realpath(root))
    found = _newest_ckpt(root, "**/last*.ckpt") or _newest_ckpt(root, "**/*.ckpt")
    if found is None:
        log.warning("the restored checkpoint %s holds no .ckpt file; starting afresh", root)
        return None
    log.info("resuming from %s", found)
    return os.fspath(found)

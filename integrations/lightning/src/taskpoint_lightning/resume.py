"""``resume_ckpt_path``: the ``ckpt_path`` that ``Trainer.fit`` resumes from (the package
docstring shows how)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from taskpoint import CheckpointLike, Coordinator, latest_checkpoint
from taskpoint.integration import (
    Disks,
    check_timeout,
    current_ranks,
    restore_to_every_disk,
    run_everywhere,
    settle_uploads,
    torch_job_coordinator,
)

__all__ = ["resume_ckpt_path"]

log = logging.getLogger(__name__)

_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
_filled: set[str] = set()


def filled_by_resume(dirpath: str | os.PathLike[str]) -> bool:
    """Whether :func:`resume_ckpt_path` restored a tree into ``dirpath`` in this process."""
    return os.path.realpath(dirpath) in _filled


def _is_global_zero() -> bool:
    """Whether this process is global rank zero, before or after a process group exists."""
    ranks = current_ranks()
    if ranks.grouped:
        return ranks.rank == 0
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
    dated = []
    for path in root.glob(pattern):
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        if files:  # (an empty folder, or a link to nothing, holds no checkpoint)
            dated.append((max(f.stat().st_mtime_ns for f in files), str(path), path))
    return max(dated)[2] if dated else None


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
    checkpoint: CheckpointLike,
    dirpath: str | os.PathLike[str] | None = None,
    *,
    timeout: float = 600.0,
) -> str | None:
    """Restore the newest mirrored checkpoint folder; the path ``Trainer.fit`` resumes from.

    Call it on every process, before ``Trainer.fit``; mirrors this process still uploads
    (a failed attempt's) are waited for first. Where the ranks can reach each other before
    Lightning starts its process group (under torchrun, or with a process group up), they
    restore together: they check that they name the same checkpoint, and the first rank of
    each disk holding ``dirpath`` restores the whole tree into it while the others wait, so
    every node holds it at the same path (as Lightning's sharded strategies expect); a
    failure on one rank raises on every rank, naming it. Under other launchers (``srun``,
    ``mpirun``, Lightning's own) global rank zero restores into ``dirpath``, every other
    process reads a private copy, and a failure raises on its own rank only.

    Args:
        checkpoint: the checkpoint given to
            :class:`~taskpoint_lightning.TaskpointModelCheckpoint`.
        dirpath: the callback's ``dirpath``: the tree is restored into it, replacing what
            it holds, so Lightning's top-k bookkeeping finds its files. ``None``: every
            process reads a private restored copy.
        timeout: with several processes, how many seconds a rank waits for the others at
            each step (the restore included).

    Returns:
        The newest ``last*.ckpt`` of the restored tree, else its newest ``*.ckpt`` (by
        modification time, which the store keeps; a sharded strategy's checkpoint is a
        folder, dated by its newest file); ``None`` when nothing was mirrored yet or the
        mirror holds no ``.ckpt`` file.

    Raises:
        taskpoint.CheckpointError: the store could not be read (on a rank whose own
            restore failed).
        taskpoint.CheckpointCoordinationError: on every other rank, when a rank failed
            (naming it, its host and its error); on every rank when the ranks name
            different checkpoints or world sizes, the ranks restoring found different
            checkpoints, a rank did not get there within ``timeout`` seconds (naming it),
            or torchrun's store could not be reached.
        ValueError: ``timeout`` is not a positive number.
    """
    check_timeout(timeout)
    settle_uploads()
    coordinator = torch_job_coordinator(timeout=timeout)
    if coordinator is None:
        if current_ranks().world_size > 1:
            log.debug("no store the ranks share before the process group: restoring alone")
        into = Path(dirpath) if dirpath is not None and _is_global_zero() else None
        return _resume(checkpoint, into)
    try:
        return _resume_everywhere(checkpoint, dirpath, coordinator)
    finally:
        coordinator.close()


def _resume(checkpoint: CheckpointLike, into: Path | None) -> str | None:
    """Restore (into ``into``, else a private copy): the path to resume from, or ``None``."""
    restored = checkpoint.load_sync()
    if restored is None:
        return None
    root = restored
    if into is not None:
        if restored.is_dir():
            root = _replace_tree(restored, into)
        else:  # a single file saved by hand: it goes into the folder all the same
            into.mkdir(parents=True, exist_ok=True)
            root = Path(shutil.move(os.fspath(restored), os.fspath(into / restored.name)))
        _filled.add(os.path.realpath(into))
    found = _newest_ckpt(root, "**/last*.ckpt") or _newest_ckpt(root, "**/*.ckpt")
    if found is None:
        log.warning("the restored checkpoint %s holds no .ckpt file; starting afresh", root)
        return None
    log.info("resuming from %s", found)
    return os.fspath(found)


def _resume_everywhere(
    checkpoint: CheckpointLike, dirpath: str | os.PathLike[str] | None, coordinator: Coordinator
) -> str | None:
    """Restore with every rank (see :func:`resume_ckpt_path`); a failure fails them all."""
    if dirpath is None:  # each rank its own private copy
        each = run_everywhere(
            coordinator, lambda: _resume(checkpoint, None), f"restore {checkpoint!r}"
        )
        return each[coordinator.rank]  # type: ignore[no-any-return]
    folder = Path(dirpath)

    def restore(disks: Disks) -> str | None:  # every disk gets the whole checkpoint
        path = _resume(checkpoint, folder)
        return None if path is None else Path(path).relative_to(folder).as_posix()

    def check(name: str | None) -> None:
        if name is None:
            return
        if not (folder / name).exists():
            raise FileNotFoundError(
                f"the restored {folder / name} is missing: was dirpath changed or removed "
                "while the checkpoint was restored?"
            )
        _filled.add(os.path.realpath(folder))

    url = getattr(checkpoint, "url", None)  # another system's checkpoint may have none
    name = restore_to_every_disk(
        coordinator, folder, restore, location=None if url is None else str(url),
        world_size=coordinator.world_size, check=check,
    )
    return None if name is None else os.fspath(folder / str(name))

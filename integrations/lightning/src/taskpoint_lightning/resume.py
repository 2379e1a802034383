"""``resume_ckpt_path``: the ``ckpt_path`` that ``Trainer.fit`` resumes from.

Example::

    ckpt = taskpoint.ctx().checkpoint
    trainer.fit(model, ckpt_path=resume_ckpt_path(ckpt, dirpath="ckpts"))   # None at first
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
from taskpoint import CheckpointCoordinationError, CheckpointLike, Coordinator, latest_checkpoint
from taskpoint.mirror import settle_uploads
from taskpoint.torch_coordination import torch_job_coordinator

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
    checkpoint: CheckpointLike,
    dirpath: str | os.PathLike[str] | None = None,
    *,
    timeout: float = 600.0,
) -> str | None:
    """Restore the newest mirrored checkpoint folder; the file ``Trainer.fit`` resumes from.

    Call it on every process, before ``Trainer.fit``. In a job of several processes whose
    ranks can reach each other before Lightning starts its process group (started by
    torchrun, whose agent serves a store to its workers, or with a ``torch.distributed``
    process group already up), every rank restores, then the ranks gather each one's
    outcome: when the restore failed on any rank, every rank raises, naming the failed
    ranks and their errors, instead of the others going on into ``Trainer.fit`` and waiting
    there for the failed one until the process group's timeout (30 minutes by default).
    Under other launchers (``srun``, ``mpirun``, Lightning's own), the ranks cannot reach
    each other yet: a failure raises on its own rank only.

    Args:
        checkpoint: the checkpoint given to
            :class:`~taskpoint_lightning.TaskpointModelCheckpoint`.
        dirpath: the callback's ``dirpath``. When given, global rank zero restores the
            tree into it, replacing what it holds, so Lightning's top-k bookkeeping finds
            its files and the next mirror keeps them; other ranks (which never write
            checkpoints) read a private restored copy. When ``None`` every process reads
            a private restored copy.
        timeout: in a job of several processes, how many seconds a rank that has restored
            waits for the others to finish their restore (and for a rank that never gets
            there, such as one killed meanwhile). A failed restore is reported at once; the
            timeout only bounds how much longer one rank's restore may take than another's.

    Returns:
        The newest ``last*.ckpt`` of the restored tree, else its newest ``*.ckpt``
        (newest by modification time, which the store keeps; a sharded strategy's
        checkpoint is a folder, dated by its newest file); ``None`` when nothing was
        mirrored yet (the first attempt) or the mirror holds no ``.ckpt`` file.

    Mirrors this process still uploads (a failed attempt's, retried in the same process)
    are waited for first, so the newest one is found.

    Raises:
        taskpoint.CheckpointError: the store could not be read (on this rank alone, where
            the ranks cannot reach each other).
        taskpoint.CheckpointCoordinationError: on every rank, when the restore failed on
            any rank (its ``ranks`` are those that failed; on a failed rank it is chained
            from the rank's own error), or a rank did not get there within ``timeout``
            seconds (naming it), or torchrun's store could not be reached.
        ValueError: ``timeout`` is not a positive number.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"resume_ckpt_path: timeout must be a positive number of seconds; got {timeout!r}")
    settle_uploads()
    coordinator = torch_job_coordinator(timeout=timeout)
    if coordinator is None:
        world = os.environ.get("WORLD_SIZE", "").strip()
        if world.isdigit() and int(world) > 1:
            log.debug("no store the ranks share before the process group: restoring alone")
        return _resume(checkpoint, dirpath)
    try:
        return _resume_everywhere(checkpoint, dirpath, coordinator)
    finally:
        coordinator.close()


def _resume(checkpoint: CheckpointLike, dirpath: str | os.PathLike[str] | None) -> str | None:
    """This process's restore: the file to resume from, or ``None``."""
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


def _where() -> str:
    """This process, for another rank's error message: its node (under torchrun) and host."""
    node = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK")
    return f"node {node}, host {socket.gethostname()}" if node else f"host {socket.gethostname()}"


def _resume_everywhere(
    checkpoint: CheckpointLike, dirpath: str | os.PathLike[str] | None, coordinator: Coordinator
) -> str | None:
    """Restore on this rank, then fail every rank when any rank's restore failed."""
    rank = coordinator.rank
    own: Exception | None = None
    found: str | None = None
    try:
        found = _resume(checkpoint, dirpath)
    except Exception as exc:
        own = exc
    outcome: dict[str, Any] = {"error": None}
    if own is not None:
        outcome = {"error": f"{type(own).__name__}: {own}", "where": _where()}
    try:
        outcomes = coordinator.all_gather(outcome)
    except CheckpointCoordinationError as exc:
        if own is None:
            raise
        raise CheckpointCoordinationError(
            f"rank {rank} ({_where()}) could not restore {checkpoint!r} ({outcome['error']}), "
            f"and could not tell the other ranks: {exc}",
            ranks=sorted({rank, *exc.ranks}),
        ) from own
    failed = [(r, o) for r, o in enumerate(outcomes) if o.get("error") is not None]
    if not failed:
        return found
    listed = "; ".join(f"rank {r} ({o.get('where')}): {o['error']}" for r, o in failed)
    error = CheckpointCoordinationError(
        f"rank {rank}: resume_ckpt_path failed on {len(failed)} of {coordinator.world_size} "
        f"rank(s), so no rank resumes: {listed}",
        ranks=[r for r, _ in failed],
    )
    if own is not None:
        raise error from own
    raise error

"""Restore the Trainer's newest complete ``checkpoint-N`` from a taskpoint checkpoint (the
package docstring shows how)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

from taskpoint import CheckpointError, CheckpointLike
from taskpoint.integration import (
    Disks,
    Ranks,
    TorchCoordinator,
    check_checkpoint_like,
    current_ranks,
    restore_to_every_disk,
    settle_uploads,
    uploads_in_flight,
    warn,
)

from taskpoint_hf import _selection

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = [
    "INCOMPLETE_MARKER",
    "TRAINER_STATE",
    "checkpoint_step",
    "last_complete_checkpoint",
    "restore_last_checkpoint",
]

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
"""The file the Trainer writes last into ``checkpoint-N``; a directory without it is partial."""
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
"""The Trainer's own marker (just-in-time checkpoints) of a ``checkpoint-N`` still being written."""
STAGING_PREFIX = ".taskpoint-restore-"
"""Prefix of the staging folder a restore uses inside ``output_dir`` (removed afterwards)."""

OutputDir = Union[str, "os.PathLike[str]", "TrainingArguments"]
"""Where the Trainer writes: its ``output_dir``, or its ``TrainingArguments``."""


def checkpoint_step(path: str | os.PathLike[str]) -> int | None:
    """The step ``N`` of a directory named ``checkpoint-N``, or ``None`` for any other name."""
    match = _selection.CHECKPOINT_NAME.match(Path(os.fspath(path)).name)
    return int(match[1]) if match else None


def _incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete Trainer checkpoint, or ``None`` when it is one."""
    if not path.is_dir():
        return "it is not a directory"
    if (path / INCOMPLETE_MARKER).exists():
        return f"it carries the Trainer's incomplete-checkpoint marker {INCOMPLETE_MARKER}"
    state = path / TRAINER_STATE
    if not state.is_file():
        return f"it has no {TRAINER_STATE}, so it was not completely written"
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"its {TRAINER_STATE} cannot be read ({type(exc).__name__}: {exc})"
    return None


@dataclass(frozen=True)
class _Scan:
    complete: list[Path]  # oldest step first
    incomplete: list[tuple[Path, str]]  # with the reason


def _scan(folder: Path, *, itself: bool = False) -> _Scan:
    """The ``checkpoint-N`` directories in ``folder`` (or ``folder`` itself, when ``itself``
    and it is named like one), sorted by ``N`` and split by completeness."""
    if itself and folder.is_dir() and checkpoint_step(folder) is not None:
        found = [folder]
    elif folder.is_dir():
        found = [p for p in folder.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    else:
        found = []
    found.sort(key=_step)
    complete: list[Path] = []
    incomplete: list[tuple[Path, str]] = []
    for path in found:
        reason = _incomplete_reason(path)
        if reason is None:
            complete.append(path)
        else:
            incomplete.append((path, reason))
    return _Scan(complete, incomplete)


def last_complete_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The complete ``checkpoint-N`` under ``folder`` with the largest ``N``, or ``None``.

    ``N`` is compared as a number (``checkpoint-10`` is newer than ``checkpoint-9``). A
    directory without ``trainer_state.json``, with an unreadable one, or carrying the
    Trainer's ``checkpoint-is-incomplete.txt`` marker is skipped with a
    :class:`~taskpoint.TaskpointWarning` when it is newer than the one returned.

    Args:
        folder: a Trainer ``output_dir`` (or a ``checkpoint-N`` directory itself).
    """
    scan = _scan(Path(os.fspath(folder)), itself=True)
    newest = scan.complete[-1] if scan.complete else None
    floor = _step(newest) if newest is not None else -1
    for path, reason in scan.incomplete:
        if _step(path) > floor:
            warn(log, f"skipping {path}: {reason}")
    return newest


def _step(path: Path) -> int:
    step = checkpoint_step(path)
    assert step is not None, path
    return step


def _target(output_dir: OutputDir) -> tuple[Path, Ranks]:
    """The output folder and this rank."""
    named = output_dir if isinstance(output_dir, (str, os.PathLike)) else None
    if named is None:
        named = getattr(output_dir, "output_dir", None)
        if named is None or not hasattr(output_dir, "process_index"):
            raise TypeError(
                "output_dir must be a str or os.PathLike naming the Trainer's output_dir, or "
                f"the Trainer's TrainingArguments (with an output_dir); got {type(output_dir).__name__}"
            )
    ranks = current_ranks()  # built, the TrainingArguments have started the process group
    if ranks.world_size > 1 and not ranks.grouped:
        raise RuntimeError(
            f"restore_last_checkpoint runs in a job of {ranks.world_size} processes but no "
            "torch.distributed process group is up, so the ranks cannot agree on a "
            "checkpoint: build the TrainingArguments first (that starts the process group) "
            "and pass them instead of the output_dir"
        )
    return Path(os.fspath(named)), ranks


def restore_last_checkpoint(
    checkpoint: CheckpointLike, output_dir: OutputDir, *, timeout: float = 600.0
) -> Path | None:
    """Restore the Trainer's output directory and return its newest complete checkpoint.

    Loads the newest committed state from ``checkpoint`` (what
    :class:`~taskpoint_hf.TaskpointTrainerCallback` mirrored) and makes the ``checkpoint-N``
    directories in ``output_dir`` exactly its complete ones (see
    :func:`last_complete_checkpoint`; ``checkpoint-N`` directories already there are
    replaced), with modification times one second apart in step order, in the past, so the
    Trainer's ``save_total_limit`` rotation keeps the newest. Uploads still running in this
    process, or (within ``TASKPOINT_GRACE_PERIOD``) in an earlier process on this machine,
    are waited for first; a newer local ``checkpoint-N`` such an upload may yet commit is
    kept, with a :class:`~taskpoint.TaskpointWarning`.

    In a distributed job the first rank of each disk restores into ``output_dir`` what the
    ranks on that disk read (every file the Trainer reads on any rank, but not other
    disks' ranks' ``rng_state_<rank>.pth`` nor DCP shards only they hold: see
    :mod:`taskpoint_hf._selection`; the whole checkpoint where that is not clearly safe),
    while the others wait; then every rank checks that it sees the restored checkpoint. Each
    step gathers every rank's outcome (waiting at most ``timeout`` seconds), so a failure on
    one rank raises on every rank.

    Args:
        checkpoint: where the callback saved the output directory (any
            :class:`~taskpoint.CheckpointLike`).
        output_dir: the Trainer's ``output_dir``, or (recommended in distributed jobs) its
            ``TrainingArguments``.
        timeout: in a distributed job, how many seconds a rank waits for the others at
            each step (the restore included).

    Returns:
        ``output_dir / "checkpoint-N"`` for the newest complete checkpoint, ready for
        ``trainer.train(resume_from_checkpoint=...)``; ``None`` when nothing was saved yet.

    Raises:
        CheckpointError: the store holds something other than a directory (and the store's
            own errors).
        CheckpointCoordinationError: on every rank of a distributed job: the ranks name
            different checkpoints or world sizes, a rank failed to restore or cannot see
            the restored checkpoint, or did not arrive within ``timeout``.
        RuntimeError: a distributed job without a process group was given a plain path.

    Warns:
        TaskpointWarning: the restored checkpoint lacks this rank's RNG state (saved by a
            job of another size): the resumed run will not repeat the uninterrupted one
            exactly.
    """
    check_checkpoint_like(checkpoint, "restore_last_checkpoint")
    folder, ranks = _target(output_dir)
    settle_uploads()  # a failed attempt's upload, when retried in this process
    if ranks.world_size < 2:
        return _resumed(folder, _restore(checkpoint, folder), ranks)

    def restore(disks: Disks) -> int | None:
        return _restore(
            checkpoint, folder, sharing=disks.sharing(ranks.rank), world_size=ranks.world_size
        )

    url = getattr(checkpoint, "url", None)  # another system's checkpoint may have none
    coordinator = TorchCoordinator(timeout=timeout)
    try:  # each step ends with every rank's outcome gathered
        step: int | None = restore_to_every_disk(
            coordinator, folder, restore, location=None if url is None else str(url),
            world_size=ranks.world_size,
            check=lambda step: _check_visible(folder, step, ranks.rank),
        )
    finally:
        coordinator.close()  # its gloo group: the callback makes its own coordinators
    return _resumed(folder, step, ranks)


def _check_visible(folder: Path, step: int | None, rank: int) -> None:
    if step is None:
        return
    path = folder / f"checkpoint-{step}"
    reason = _incomplete_reason(path)
    if reason is not None:
        raise CheckpointError(
            f"rank {rank} cannot use the restored {path}: {reason}; was its output_dir "
            "changed or removed while the checkpoint was restored?"
        )


def _resumed(folder: Path, step: int | None, ranks: Ranks) -> Path | None:
    if step is None:
        return None
    path = folder / f"checkpoint-{step}"
    if ranks.world_size > 1 and not (path / f"rng_state_{ranks.rank}.pth").is_file():
        warn(log, f"rank {ranks.rank}: {path} holds no rng_state_{ranks.rank}.pth, so this "
             "rank resumes with fresh random state and the run will not repeat an "
             "uninterrupted one exactly (the checkpoint was saved by a job of another size, "
             "or without this rank's node's files)")
    log.info("resuming from %s", path)
    return path


def _still_committing(checkpoint: CheckpointLike, stale: _Scan, restored: _Scan) -> set[Path]:
    """The complete local ``checkpoint-N`` directories newer than the newest restored that
    an upload still in flight on this machine may yet commit (an earlier attempt's upload
    process outlives it): a restore keeps them, with a warning, rather than delete what
    may become the newest checkpoint."""
    floor = _step(restored.complete[-1]) if restored.complete else -1
    newer = [p for p in stale.complete if _step(p) > floor]
    if not newer:
        return set()
    url = getattr(checkpoint, "url", None)
    if not uploads_in_flight(url if isinstance(url, str) else None):
        return set()
    for path in newer:
        warn(log, f"keeping {path}, which is not part of the checkpoint being restored: an "
             "upload of an earlier attempt still in flight on this machine may yet commit it")
    return set(newer)


def _restore(
    checkpoint: CheckpointLike,
    folder: Path,
    *,
    sharing: tuple[int, ...] = (0,),
    world_size: int = 1,
) -> int | None:
    """Load, vet and move the checkpoints into ``folder``; the newest step or ``None``.

    ``sharing``: the ranks whose disk holds ``folder``, of a job of ``world_size``; what
    only other ranks read is left out where that is safe (:func:`_selection.load`).
    """
    tree = _selection.load(checkpoint, ranks=sharing, world_size=world_size)
    if tree is not None and not tree.is_dir():
        raise CheckpointError(
            f"{checkpoint!r} holds the file {tree.name!r}, not a Trainer output directory; "
            "restore_last_checkpoint expects what TaskpointTrainerCallback saves there"
        )
    scan = _scan(tree, itself=True) if tree is not None else _Scan([], [])
    for path, reason in scan.incomplete:
        warn(log, f"skipping {path.name} from {checkpoint!r}: {reason}")
    if tree is not None and not scan.complete:
        warn(log, f"{checkpoint!r} holds no complete checkpoint-N directory; starting from scratch")

    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(f"{STAGING_PREFIX}*"):  # from a restore that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    stale = _scan(folder)
    names = {path.name for path in scan.complete}
    kept = _still_committing(checkpoint, stale, scan)
    for path in [*stale.complete, *(p for p, _ in stale.incomplete)]:
        if path in kept:
            continue
        if path.name not in names:
            log.warning("removing %s: it is not part of the checkpoint being restored", path)
        shutil.rmtree(path)
    if not scan.complete:
        return None

    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder))
    try:
        for path in scan.complete:
            shutil.move(os.fspath(path), os.fspath(staging / path.name))
        for path in scan.complete:
            os.replace(staging / path.name, folder / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # The Trainer's rotation deletes the oldest by mtime and keeps the newest; the archive
    # carried the writer's mtimes (another machine's clock, maybe ahead of ours), so give
    # the restored directories past mtimes in step order.
    now = time.time()
    count = len(scan.complete)
    for index, path in enumerate(scan.complete):
        stamp = now - (count - index)
        os.utime(folder / path.name, (stamp, stamp))
    log.info(
        "restored %d checkpoint(s) into %s from %r, newest %s",
        count, folder, checkpoint, scan.complete[-1].name,
    )
    return _step(scan.complete[-1])

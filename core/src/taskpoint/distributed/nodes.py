"""Folders written on several nodes' own disks: saved as one checkpoint, restored to each.

A framework that writes its checkpoints into a local ``output_dir`` on every node (Hugging
Face's Trainer, Lightning) leaves each node's share there: RNG states per rank, shards of a
sharded state dict, the model files of the node that saved them. The adapters use this
module, over a :class:`~taskpoint.distributed.coordination.Coordinator` spanning every rank, to

* find which ranks share a disk (:func:`find_disks`: each rank writes a token file into the
  folder and reports which ranks' tokens it sees), so a shared disk is uploaded once and
  restored once;
* stage each rank's part (:func:`stage_part`): the lowest rank on each disk lists the
  folder; a later disk adds only files inside the top-level folders the first disk has (a
  node that does not save the model still writes its ranks' RNG files into
  ``checkpoint-N``, and keeps old ones the first node's rotation deleted), and a path
  several disks hold is uploaded from the disk whose copy is newest (ties: the first in
  rank order), so a file one node rewrites in place (its shard of Lightning's
  ``last.ckpt``) wins over the stale copy a restore left on another disk. Hard links to those files go into a staging
  folder inside the folder, which :meth:`taskpoint.Checkpoint.save_part_sync` then commits
  with every other rank's;
* run one step on every rank and fail every rank when one fails (:func:`run_everywhere`), so
  a failure on one node never leaves the others waiting in a collective;
* restore a checkpoint into the folder once per disk, the ranks agreeing first on what
  they restore and then on what they found (:func:`restore_to_every_disk`).

Example (every rank, in the framework's save hook)::

    disks = find_disks(coordinator, output_dir)           # once
    part = stage_part(coordinator, output_dir, disks)      # after every rank wrote its files
    checkpoint.save_part_sync(part, coordinator=coordinator)
    shutil.rmtree(part.parent)

Names starting with ``.taskpoint-`` at the folder's top level (tokens, staging folders,
restores in progress) are never uploaded.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taskpoint.distributed.coordination import Coordinator, check_agreement
from taskpoint.errors import CheckpointCoordinationError

__all__ = [
    "PRIVATE_PREFIX", "Disks", "discard_stale_parts", "find_disks", "list_files",
    "restore_to_every_disk", "run_everywhere", "stage_part",
]

PRIVATE_PREFIX = ".taskpoint-"
"""Top-level names in a mirrored folder that belong to taskpoint and are never uploaded."""
TOKEN_PREFIX = f"{PRIVATE_PREFIX}disk-"
PART_PREFIX = f"{PRIVATE_PREFIX}part-"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_everywhere(coordinator: Coordinator, action: Callable[[], Any], what: str) -> list[Any]:
    """Run ``action`` on this rank, then gather every rank's outcome.

    Args:
        coordinator: every rank taking part (each calls this, in the same order).
        action: this rank's step; returns a small JSON value.
        what: the step, for the error message ("restore the checkpoint").

    Returns:
        Every rank's value, in rank order.

    Raises:
        Exception: this rank's own error, when ``action`` raised.
        CheckpointCoordinationError: another rank's ``action`` raised (naming it, its host
            and its error), or a rank did not arrive within the coordinator's timeout.
    """
    own: BaseException | None = None
    value: Any = None
    try:
        value = action()
    except Exception as exc:
        own = exc
    outcomes = coordinator.all_gather(
        {"error": None, "value": value} if own is None
        else {"error": _describe(own), "host": socket.gethostname()}
    )
    if own is not None:
        raise own
    failed = [(r, o) for r, o in enumerate(outcomes) if o.get("error") is not None]
    if failed:
        listed = "; ".join(f"rank {r} (host {o.get('host')}): {o['error']}" for r, o in failed)
        raise CheckpointCoordinationError(
            f"rank {coordinator.rank} cannot go on: another rank failed to {what} ({listed})",
            ranks=[r for r, _ in failed],
        )
    return [o.get("value") for o in outcomes]


@dataclass(frozen=True)
class Disks:
    """Which ranks share a disk (as seen through one folder).

    Attributes:
        leaders: for each rank, the lowest rank that sees the same folder (its disk's
            leader, which lists, uploads and restores for the disk).
    """

    leaders: tuple[int, ...]

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` lists, uploads and restores for its disk."""
        return self.leaders[rank] == rank

    @property
    def count(self) -> int:
        """How many distinct disks the ranks write to."""
        return len(set(self.leaders))

    def sharing(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s disk (``rank`` among them), in rank order."""
        leader = self.leaders[rank]
        return tuple(r for r, other in enumerate(self.leaders) if other == leader)


def find_disks(coordinator: Coordinator, folder: Path) -> Disks:
    """Find which ranks see the same ``folder`` (a collective: every rank calls it).

    Each rank writes ``.taskpoint-disk-<rank>`` holding a token rank 0 chose, then reports
    the ranks whose token it finds; the files are removed afterwards.

    Raises:
        OSError: this rank cannot create the folder or write its token.
        CheckpointCoordinationError: another rank could not, or did not arrive in time.
    """
    rank, world = coordinator.rank, coordinator.world_size
    token = coordinator.broadcast(secrets.token_hex(16))
    own = folder / f"{TOKEN_PREFIX}{rank}"

    def write() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        own.write_text(str(token), encoding="utf-8")

    run_everywhere(coordinator, write, f"write a token into {str(folder)!r}")

    def look() -> list[int]:
        seen = []
        for other in range(world):
            try:
                found = (folder / f"{TOKEN_PREFIX}{other}").read_text(encoding="utf-8")
            except OSError:
                continue
            if found == token:
                seen.append(other)
        return seen

    try:
        seen = run_everywhere(coordinator, look, f"look for tokens in {str(folder)!r}")
    finally:
        own.unlink(missing_ok=True)  # every rank has looked once the gather returns
    leaders = tuple(min(s) if isinstance(s, list) and s else r for r, s in enumerate(seen))
    return Disks(leaders)


def restore_to_every_disk(
    coordinator: Coordinator,
    folder: Path,
    restore: Callable[[Disks], Any],
    *,
    location: str | None,
    world_size: int,
    check: Callable[[Any], object] | None = None,
) -> Any:
    """Restore a checkpoint into ``folder`` once on each disk (a collective).

    First the ranks check that they all name the same checkpoint ``location`` and
    ``world_size``; then they find which of them share ``folder`` (:func:`find_disks`), and
    the leader of each disk runs ``restore`` while the others wait; last, the leaders'
    results must be equal (they found the same checkpoint). Every step gathers every
    rank's outcome, so a failure on one rank raises on all of them.

    Args:
        coordinator: every rank of the job.
        folder: the local folder the checkpoint is restored into (shared by some ranks,
            or each rank's own).
        restore: fills ``folder`` and returns a small JSON value saying what it restored
            (the checkpoint's step, say); run by each disk's leader only, given the ranks'
            :class:`Disks` (so it can restore just what the ranks on its disk need).
        location: the checkpoint's URL as this rank names it (``None`` where the
            checkpoint object has none).
        world_size: the job's size as this rank sees it.
        check: called on every rank with what ``restore`` returned, once every disk is
            restored: raises where this rank cannot use the restored checkpoint (its copy
            missing or incomplete); ``None``: no check.

    Returns:
        What ``restore`` returned (the same on every rank).

    Raises:
        CheckpointCoordinationError: on every rank: the ranks name different locations or
            world sizes (nothing was restored), a rank failed (naming it and its error),
            the leaders restored different things, ``check`` failed on a rank, or a rank
            did not arrive in time.
        Exception: on a rank whose own step failed, its own error.
    """
    rank = coordinator.rank
    hellos = coordinator.all_gather({"url": location, "world_size": world_size})
    check_agreement(
        [h.get("url") for h in hellos], [h.get("world_size") for h in hellos],
        undone="Nothing was restored",
    )
    disks = find_disks(coordinator, folder)
    results = run_everywhere(
        coordinator, lambda: restore(disks) if disks.leads(rank) else None,
        f"restore {location or 'the checkpoint'} into {str(folder)!r}",
    )
    found = {json.dumps(results[r], sort_keys=True) for r in set(disks.leaders)}
    if len(found) != 1:
        raise CheckpointCoordinationError(
            f"the ranks restoring {str(folder)!r} found different checkpoints "
            f"({', '.join(sorted(found))}); was the store written to while they read it?"
        )
    if check is not None:
        run_everywhere(coordinator, lambda: check(results[0]), "see the restored checkpoint")
    return results[0]


def list_files(folder: Path) -> list[str]:
    """The files under ``folder`` (relative POSIX paths, sorted), without taskpoint's own."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        if here == folder:
            dirnames[:] = [d for d in dirnames if not d.startswith(PRIVATE_PREFIX)]
            filenames = [f for f in filenames if not f.startswith(PRIVATE_PREFIX)]
        found.extend((here / name).relative_to(folder).as_posix() for name in filenames)
    return sorted(found)


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def stage_part(coordinator: Coordinator, folder: Path, disks: Disks) -> Path:
    """Stage this rank's part of ``folder`` for a multi-writer save (a collective).

    Every disk's leader lists the folder; the ranks agree on who uploads what (see the
    module docstring), and each rank hard-links its share (copying where links fail) into
    a folder named like ``folder`` inside a new ``.taskpoint-part-*`` folder in ``folder``
    (so the committed tree keeps ``folder``'s name): empty on ranks that lead no disk. The
    caller removes the ``.taskpoint-part-*`` folder (the returned path's parent) once saved.

    Returns:
        This rank's part: the folder to pass to ``save_part_sync``.

    Raises:
        OSError: this rank could not list or stage.
        CheckpointCoordinationError: another rank could not, or did not arrive in time.
    """
    rank = coordinator.rank
    def listing() -> list[tuple[str, int]]:
        if not disks.leads(rank):
            return []
        return [(p, (folder / p).stat().st_mtime_ns) for p in list_files(folder)]

    listings = run_everywhere(coordinator, listing, f"list {str(folder)!r}")
    tops = {p.split("/", 1)[0] for p, _ in listings[0] or [] if "/" in p}
    best: dict[str, tuple[int, int]] = {}  # path -> (modification time, rank uploading it)
    for other, listed in enumerate(listings):
        for path, mtime in listed or []:
            if other and not ("/" in path and path.split("/", 1)[0] in tops):
                continue
            if path not in best or mtime > best[path][0]:
                best[path] = (mtime, other)
    mine = sorted(path for path, (_, owner) in best.items() if owner == rank)

    made: list[Path] = []
    name = folder.absolute().name or "output"

    def stage() -> str:
        outer = Path(tempfile.mkdtemp(prefix=f"{PART_PREFIX}{rank}-", dir=folder))
        made.append(outer)
        part = outer / name  # the committed tree takes rank 0's folder name
        part.mkdir()
        for path in mine:
            _link(folder / path, part / path)
        return os.fspath(part)

    try:
        run_everywhere(coordinator, stage, f"stage its files of {str(folder)!r}")
    except BaseException:
        for part in made:
            shutil.rmtree(part, ignore_errors=True)
        raise
    return made[0] / name


def discard_stale_parts(folder: Path) -> None:
    """Remove staging folders a killed process left in ``folder``."""
    if folder.is_dir():
        for leftover in folder.glob(f"{PART_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)

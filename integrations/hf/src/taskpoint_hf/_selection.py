"""Which files of a multi-node Trainer checkpoint the ranks on one disk need.

:func:`load` restores, per disk, every file the Trainer on any rank reads (and everything
outside ``checkpoint-N``), leaving out only other disks' ranks' ``rng_state_<r>.pth`` and,
in a ``torch.distributed.checkpoint`` folder (``.metadata``), the ``__<r>_<j>.distcp`` files
of ranks on other disks whose every item is rank ``r``'s own chunk of a tensor stored one
chunk per rank (anything else may be read by another rank: the file stays; so does every
file of a folder whose ``.metadata`` cannot be read). The whole checkpoint is restored
whenever that is not clearly safe: not a :class:`taskpoint.Checkpoint`, not a format-2
tree written by one part per rank of a job of this size, one disk for all ranks, nothing
to leave out, or a commit landing meanwhile (never a mix of two). Shards are matched to
ranks by number: another sharding at the same world size fails loudly in DCP.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taskpoint import Checkpoint, CheckpointCoordinationError, CheckpointLike
from taskpoint.integration import Manifest, remove_scratch_folder, scratch_folder

__all__ = ["CHECKPOINT_NAME", "DCP_METADATA", "Selection", "load", "select"]

log = logging.getLogger(__name__)

DCP_METADATA = ".metadata"
"""The file naming a ``torch.distributed.checkpoint`` folder (it describes every shard)."""

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
"""The name of a Trainer checkpoint folder, ``checkpoint-N``; its group is the step."""
_RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class Selection:
    """What one disk restores of the commit ``manifest``: ``paths`` of its tree, leaving
    out the files other disks' ranks need alone (``left_out``, sorted)."""

    manifest: Manifest
    paths: frozenset[str]
    left_out: tuple[str, ...]


def load(checkpoint: CheckpointLike, *, ranks: Collection[int], world_size: int) -> Path | None:
    """Restore the newest checkpoint, only what ``ranks`` (those sharing the disk, of a
    job of ``world_size``) need when that is safe: the tree ``load_sync`` returns (with
    :func:`select`'s paths, or whole; whole after a race with a newer commit), ``None``
    when nothing was committed.

    Raises:
        CheckpointError: the store's errors.
    """
    try:
        selection = select(checkpoint, ranks=ranks, world_size=world_size)
        if selection is not None:
            tree = checkpoint.load_sync(paths=selection.paths)  # type: ignore[call-arg]
    except CheckpointCoordinationError as exc:  # the newest commit changed, or lacks some paths
        log.warning("restoring the whole checkpoint: %s", exc)
        selection = None
    if selection is None:
        return checkpoint.load_sync()
    assert isinstance(checkpoint, Checkpoint)  # select() chooses paths of a Checkpoint only
    newest = checkpoint.committed()
    if not newest or newest[0].key != selection.manifest.key:
        log.warning(
            "restoring the whole checkpoint: %s was committed after %s, whose files for "
            "ranks %s were being restored", newest[0].key if newest else "nothing",
            selection.manifest.key, sorted(ranks),
        )
        if tree is not None:
            shutil.rmtree(tree, ignore_errors=True)
        return checkpoint.load_sync()
    log.info(
        "restored %d of the %d paths of %s for ranks %s, leaving out %d files only other "
        "disks' ranks read", len(selection.paths), len(selection.manifest.entries or ()),
        selection.manifest.key, sorted(ranks), len(selection.left_out),
    )
    return tree


def select(
    checkpoint: CheckpointLike, *, ranks: Collection[int], world_size: int
) -> Selection | None:
    """What ``ranks`` (those sharing one disk, of a job of ``world_size``) need of the
    newest commit, from its manifest and its DCP folders' ``.metadata`` (restored into a
    temporary folder); ``None`` where the whole checkpoint is to be restored.

    Raises:
        CheckpointCoordinationError: a newer commit replaced the one read while its
            ``.metadata`` files were restored.
        CheckpointError: the store's errors.
    """
    here = frozenset(ranks)
    if not isinstance(checkpoint, Checkpoint) or here >= frozenset(range(world_size)):
        return None  # another system's checkpoint (no parts), or one disk needing all
    committed = checkpoint.committed()
    if not committed:
        return None
    manifest = committed[0]
    if manifest.entries is None or manifest.parts is None:
        return None  # format 1, or written by one process
    if set(manifest.parts) != {str(r) for r in range(world_size)}:
        return None  # another job size wrote it: resharding needs everything
    files = [e.path for e in manifest.entries if e.type != "dir"]
    inside = [p for p in files if "/" in p and CHECKPOINT_NAME.match(p.split("/", 1)[0])]
    rng = _rng_files(inside, world_size)
    if rng is None:
        return None
    left_out = {path for path, rank in rng.items() if rank not in here}
    folders = sorted(
        p.rpartition("/")[0] for p in inside if p.rpartition("/")[2] == DCP_METADATA
    )
    if folders:
        metadata = _read_metadata(checkpoint, folders)
        for folder in folders:
            left_out |= _shards_left_out(folder, inside, metadata.get(folder), here, world_size)
    if not left_out:
        return None
    parents = {p.rpartition("/")[0] for p in (e.path for e in manifest.entries) if "/" in p}
    empty = {e.path for e in manifest.entries if e.type == "dir" and e.path not in parents}
    paths = frozenset(p for p in files if p not in left_out) | empty
    return Selection(manifest, paths, tuple(sorted(left_out)))


def _rng_files(inside: list[str], world_size: int) -> dict[str, int] | None:
    """``checkpoint-N/rng_state_<r>.pth`` paths to ``r``; ``None`` unless each
    ``checkpoint-N`` holding any names exactly ranks ``0 .. world_size - 1``."""
    found: dict[str, int] = {}
    by_folder: dict[str, set[int]] = defaultdict(set)
    for path in inside:
        folder, _, name = path.partition("/")
        match = _RNG_RE.match(name)
        if match is None:
            continue
        if match[1] is None:
            return None  # a one-process job's rng_state.pth
        found[path] = int(match[1])
        by_folder[folder].add(int(match[1]))
    if any(held != set(range(world_size)) for held in by_folder.values()):
        return None
    return found


def _read_metadata(checkpoint: Checkpoint, folders: list[str]) -> dict[str, Any]:
    """Each DCP folder's parsed ``.metadata``; a folder whose file cannot be read is
    left out (its shards are all kept)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    scratch = scratch_folder()  # a kill mid-read leaves it to the next process's sweep
    try:
        tree = checkpoint.load_sync(
            into=str(scratch), paths=[f"{folder}/{DCP_METADATA}" for folder in folders]
        )
        found: dict[str, Any] = {}
        for folder in folders:
            try:
                assert tree is not None
                found[folder] = FileSystemReader(str(tree / folder)).read_metadata()
            except Exception as exc:  # anything unreadable: keep every shard file
                log.warning(
                    "keeping every shard of %s: its %s cannot be read (%s: %s)",
                    folder, DCP_METADATA, type(exc).__name__, exc,
                )
    finally:
        remove_scratch_folder(scratch)
    return found


def _shards_left_out(
    folder: str, inside: list[str], metadata: Any, here: frozenset[int], world_size: int
) -> set[str]:
    """The ``__<r>_<j>.distcp`` files of ``folder`` that only ranks off this disk read."""
    shards: dict[str, int] = {}
    for path in inside:
        parent, _, name = path.rpartition("/")
        match = _SHARD_RE.match(name)
        if parent == folder and match is not None:
            shards[name] = int(match[1])
    if metadata is None or set(shards.values()) != set(range(world_size)):
        return set()  # unreadable, or not one prefix per rank of this job: keep them all
    own = _own_files(metadata, shards, world_size)
    return {f"{folder}/{name}" for name, rank in shards.items() if rank not in here and name in own}


def _own_files(metadata: Any, shards: dict[str, int], world_size: int) -> set[str]:
    """The files of a DCP folder holding nothing but their writer's own shards.

    An item is a rank's own when its tensor is stored as ``world_size`` chunks, each in
    another rank's file: each rank wrote its own chunk there, and under the same sharding
    reads it back from there alone. Bytes, whole tensors and chunks several ranks hold
    (the planner stores those once, in any rank's file) make a file everybody's.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = getattr(metadata, "storage_data", None)
    described = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(storage, dict) or not isinstance(described, dict):
        return set()
    ranks_of: dict[str, list[int]] = defaultdict(list)  # fqn -> the rank of each chunk's file
    files: dict[str, set[str]] = defaultdict(set)  # file -> the fqns it holds
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if name not in shards:
            return set()  # a file this tree does not hold: something else wrote it
        ranks_of[index.fqn].append(shards[name])
        files[name].add(index.fqn)
    own_fqns = {
        fqn for fqn, held in ranks_of.items()
        if isinstance(described.get(fqn), TensorStorageMetadata)
        and len(described[fqn].chunks) == world_size
        and sorted(held) == list(range(world_size))
    }
    return {name for name, fqns in files.items() if fqns <= own_fqns}

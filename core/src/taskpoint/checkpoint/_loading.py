"""Loading: how a :class:`~taskpoint.Checkpoint` restores its newest intact checkpoint.

:class:`Loading` gives ``Checkpoint`` ``load_sync`` and ``load``: they check the request,
let the restore (:class:`taskpoint.checkpoint._load.Loader`) find and fetch the checkpoint,
and record the resume in the run's history (:mod:`taskpoint.format.history`).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Collection
from pathlib import Path

from taskpoint.checkpoint import _inflight
from taskpoint.checkpoint._load import Loader
from taskpoint.checkpoint._save import Saves
from taskpoint.format import history
from taskpoint.format.manifest import check_paths
from taskpoint.store.store import Store

__all__ = ["Loading"]


class Loading:
    """The load methods of :class:`~taskpoint.Checkpoint`, which inherits them.

    It holds nothing of its own: it works through the collaborators ``Checkpoint``'s
    constructor makes (its loader and saves, the store, the attempt).
    """

    _store: Store
    _saves: Saves
    _loader: Loader
    _attempt: history.Attempt

    def load_sync(
        self,
        *,
        into: str | os.PathLike[str] | None = None,
        part: int | None = None,
        paths: Collection[str] | None = None,
    ) -> Path | None:
        """Restore the newest intact committed checkpoint to a local path.

        Args:
            into: a local directory to restore into instead of a fresh folder. A directory
                checkpoint's tree *becomes* ``into``: files already there with the right
                size and content are kept rather than downloaded (a retry on the same
                machine fetches only what is missing), the others are replaced, and
                anything the checkpoint does not hold is removed. A file or bytes
                checkpoint is placed in ``into`` under its name. Nothing in ``into``
                changes unless the whole checkpoint restored and verified. With ``part``
                or ``paths``, ``into`` ends up holding just what they select.
            part: restore only the files rank ``part`` contributed to a checkpoint written
                by several processes (:meth:`~taskpoint.Checkpoint.save_part_sync`);
                ``None``: the whole tree.
            paths: restore only these paths of a directory checkpoint stored in format 2
                (relative to the tree, ``/`` between components, e.g.
                ``["model/__0_0.distcp", ".metadata"]``): the objects other files use are
                never downloaded. A directory path brings everything under it; the
                directories containing each path come along, and so does the file a
                requested hard link shares; a symbolic link comes as a link, without its
                target. With ``part`` too, each path must be one of that part's.
                ``None``: the whole tree.

        Returns:
            The restored file (keeping its name), the restored directory tree, or a file
            named ``checkpoint.bin`` holding saved bytes; ``None`` when nothing has been
            committed. Without ``into`` each call restores afresh into a new folder.

        A checkpoint that fails its checksum or cannot be read back is skipped, with a
        :class:`~taskpoint.TaskpointWarning` naming it, for the next newest.

        Uploads to this location still in flight from another process on this machine (the
        upload process of an attempt that died, which goes on to commit its save) are
        waited for first, at most the grace period (``TASKPOINT_GRACE_PERIOD``, default
        30 s), so a retry restores the save its predecessor was committing; an upload
        process that has died is not waited for.

        Raises:
            CheckpointCorruptError: checkpoints exist but none is intact.
            CheckpointFormatError: the newest manifest comes from a newer format.
            CheckpointUnsafeError: a directory archive holds an unsafe entry.
            CheckpointStoreError: the store failed (after retries for transient errors).
            CheckpointCoordinationError: ``part`` was given and the newest checkpoint has
                no such part (one process wrote it, or fewer ranks); or ``paths`` was given
                and the newest checkpoint is not a format-2 tree, or holds none of some of
                them (the message names them). Nothing was restored: an older checkpoint
                is never taken instead.
            ValueError: ``part`` is not a rank; ``paths`` is a string, not a collection,
                or holds a path that is not a relative one inside the tree (empty,
                absolute, or with ``.`` or ``..`` components); ``TASKPOINT_GRACE_PERIOD``
                is set to something other than seconds.
        """
        if part is not None and (isinstance(part, bool) or not isinstance(part, int) or part < 0):
            raise ValueError(f"part must be a rank (an int of at least 0) or None; got {part!r}")
        wanted = None if paths is None else check_paths(paths)
        # An earlier attempt's upload process may be about to commit a newer checkpoint.
        _inflight.wait(self._store.url, _inflight.wait_bound())
        self._saves.prepare()  # a job loads before it trains: its saves follow
        found = self._loader.load(None if into is None else Path(os.fspath(into)), part, wanted)
        if found is None:
            return None
        path, manifest, elapsed = found
        self._saves.restored = (manifest.size, elapsed, manifest.stats)
        self._attempt.resumed(manifest, elapsed)
        history.log_resume(self._store, manifest, self._attempt.number)
        return path

    async def load(
        self,
        *,
        into: str | os.PathLike[str] | None = None,
        part: int | None = None,
        paths: Collection[str] | None = None,
    ) -> Path | None:
        """Async :meth:`load_sync`: the download runs in worker threads."""
        return await asyncio.to_thread(
            functools.partial(self.load_sync, into=into, part=part, paths=paths)
        )

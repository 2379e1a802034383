"""One checkpoint written by several processes, as :class:`~taskpoint.Checkpoint` offers it.

:class:`MultiWriter` gives ``Checkpoint`` its multi-writer methods: ``save_part_sync`` and
``save_part`` run the whole protocol over a :class:`taskpoint.Coordinator`;
``begin_parts`` and ``upload_part`` are its steps, for adapters that coordinate their ranks
themselves. The protocol is :mod:`taskpoint.distributed._parts`'s; the save lease and the
listeners of the commit are the checkpoint's saves' (:class:`taskpoint.checkpoint._save.Saves`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path
from typing import Any

from taskpoint.checkpoint._save import Saves
from taskpoint.distributed import _parts
from taskpoint.distributed.coordination import Coordinator
from taskpoint.format._catalog import Catalog
from taskpoint.format._digest import Progress
from taskpoint.format.manifest import Codec
from taskpoint.store.store import Store

__all__ = ["MultiWriter"]


class MultiWriter:
    """The multi-writer methods of :class:`~taskpoint.Checkpoint`, which inherits them.

    It holds nothing of its own: it works through the collaborators ``Checkpoint``'s
    constructor makes (its saves, the store and its catalog) and its codec and progress.
    """

    _store: Store
    _catalog: Catalog
    _saves: Saves
    _codec: Codec
    _progress: Progress | None

    def save_part_sync(
        self,
        path: str | os.PathLike[str],
        *,
        coordinator: Coordinator,
        step: int | None = None,
        noticed: bool | None = None,
    ) -> None:
        """Commit one checkpoint written by several processes: this one adds ``path``'s tree.

        Every rank of ``coordinator`` calls this with its own local directory; each uploads
        its own files (as format-2 content objects) and rank 0 commits the union of the
        trees once every rank's files are in the store and checked there. Until that commit
        nothing loads the checkpoint; a rank that fails or is killed leaves the previous
        checkpoint the newest. ``load_sync(part=rank)`` restores one rank's files alone.

        Every rank returns once the commit is done, or raises. A path two ranks write must
        hold the same content in both (a shared ``.metadata``, say). A rank that vanishes
        after rank 0 gathered its part does not undo the commit: rank 0 broadcasts the
        outcome, and a :class:`taskpoint.StoreCoordinator`'s broadcast waits for rank 0
        alone, so the others return. A rank that misses the outcome (rank 0 vanished
        after committing, or the coordinator's broadcast waits for every rank) raises,
        with the error's ``committed`` naming the manifest if a fresh listing of the
        store shows it.

        Args:
            path: this rank's local directory.
            coordinator: the ranks writing the checkpoint (a
                :class:`taskpoint.StoreCoordinator`, or
                ``taskpoint.distributed.torch_coordination.TorchCoordinator`` under
                ``torch.distributed``). Its timeout bounds how long a rank waits for
                the others at each step, uploads included.
            step: the training step the checkpoint holds; ``None``: the one last given to
                :func:`taskpoint.report_step`, now. Pass it when this call runs later
                than the save was asked for (in a background thread).
            noticed: whether the save was asked for after the preemption signal
                (:func:`taskpoint.preemption.requested`); ``None``: as it is now.

        Raises:
            CheckpointCoordinationError: on every rank: the ranks named different checkpoint
                URLs or world sizes (before anything is uploaded), two ranks wrote one path
                with different content, another rank failed, or a rank did not arrive
                within the coordinator's timeout (naming it). Its ``committed`` is the
                manifest's URL if the checkpoint was committed all the same (a rank
                vanished after its part was gathered and this rank missed the outcome),
                else ``None``: nothing this rank saw was committed.
            NotADirectoryError: ``path`` is not a directory (on this rank; the others raise
                ``CheckpointCoordinationError`` naming it).
            CheckpointUnsafeError: the directory holds a special file or a link leaving it.
            CheckpointStoreError: the store failed.
            CheckpointClosedError: :meth:`~taskpoint.Checkpoint.close` was called.
        """
        called = time.monotonic()
        self._saves.check_open()
        if not isinstance(coordinator, Coordinator):
            raise TypeError(
                "coordinator must be a taskpoint.Coordinator (StoreCoordinator, "
                f"TorchCoordinator); got {type(coordinator).__name__}"
            )
        root = Path(os.fspath(path)).absolute()
        self._saves.raise_error()
        _parts.save_part(
            lambda: _parts.check_part(root),
            lambda: self._saves.begin_parts(called),
            lambda: self.upload_part(root, step=step, noticed=noticed),
            coordinator,
            self._store.url,
            self._find_manifest,
        )

    def _find_manifest(self, key: str) -> str | None:
        """The URL of the manifest at ``key`` if a fresh listing of its folder shows it.

        Never a cached answer: an object store's filesystem keeps the listing it made before
        another process committed (s3fs's directory cache), which would deny the commit.
        """
        folder, _, name = key.rpartition("/")
        return self._store.url_of(key) if name in self._store.list(folder) else None

    async def save_part(
        self, path: str | os.PathLike[str], *, coordinator: Coordinator
    ) -> None:
        """Async :meth:`save_part_sync`: the protocol runs in a worker thread."""
        await asyncio.to_thread(
            functools.partial(self.save_part_sync, path, coordinator=coordinator)
        )

    def begin_parts(self) -> _parts.PartsCommit:
        """Start a multi-writer commit, on the one process that will commit it.

        For adapters that coordinate their ranks themselves (as ``torch.distributed.checkpoint``
        does); :meth:`save_part_sync` does all of this for you. The steps: the committing
        rank calls ``begin_parts()``; after that (a collective later) every rank calls
        :meth:`upload_part` with its folder and sends the record it returns to the
        committer, which calls ``commit(records)`` with them in rank order, or ``abort()``.
        Until ``commit`` nothing loads the checkpoint.

        Returns:
            A :class:`taskpoint.PartsCommit` holding a save lease, usable as a context
            manager that aborts unless committed.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointClosedError: :meth:`~taskpoint.Checkpoint.close` was called.
        """
        return self._saves.begin_parts(time.monotonic())

    def upload_part(
        self, path: str | os.PathLike[str], *, step: int | None = None,
        noticed: bool | None = None,
    ) -> dict[str, Any]:
        """Upload one rank's folder for a multi-writer commit (see :meth:`begin_parts`).

        ``step`` and ``noticed`` as for :meth:`save_part_sync` (the committing rank's
        record gives the checkpoint its step; any rank's notice marks it a preemption save).

        Returns:
            The part's JSON record (its paths, content hashes and object names: metadata
            only) for the committing rank's ``commit``.

        Raises:
            NotADirectoryError: ``path`` is not a directory.
            CheckpointUnsafeError: it holds a special file or a link leaving it.
            CheckpointStoreError: the store failed.
            CheckpointClosedError: :meth:`~taskpoint.Checkpoint.close` was called.
        """
        self._saves.check_open()
        return _parts.upload_part(
            self._catalog, Path(os.fspath(path)).absolute(), codec=self._codec,
            progress=self._progress, step=step, noticed=noticed,
        )

"""What a :class:`~taskpoint.Checkpoint`'s location holds: listed, verified, pruned, collected.

:class:`Stored` gives ``Checkpoint`` its methods over the checkpoints already committed:
``committed``, ``verify``, ``prune``, ``collect`` and ``delete``. The work is
:class:`taskpoint.format._catalog.Catalog`'s (and the store's, for ``delete``).
"""

from __future__ import annotations

from taskpoint.format import retention
from taskpoint.format._catalog import Catalog
from taskpoint.format.manifest import Manifest
from taskpoint.store.store import Store

__all__ = ["Stored"]


class Stored:
    """The stored-checkpoint methods of :class:`~taskpoint.Checkpoint`, which inherits them.

    It holds nothing of its own: it works through the collaborators ``Checkpoint``'s
    constructor makes (the store and its catalog).
    """

    _store: Store
    _catalog: Catalog

    def committed(self) -> list[Manifest]:
        """The committed checkpoints' manifests, newest first, without verifying payloads.

        Manifests that cannot be parsed are left out.

        Raises:
            CheckpointStoreError: the store failed.
            CheckpointFormatError: a manifest comes from a newer format.
        """
        return self._catalog.newest_first()

    def verify(self, manifest: Manifest) -> bool:
        """Whether ``manifest``'s payload exists and matches its size and checksum.

        Reads the payload through without writing it anywhere.

        Raises:
            CheckpointStoreError: the store failed.
        """
        return self._catalog.verify(manifest)

    def prune(self, keep: int) -> int:
        """Keep the newest ``keep`` intact checkpoints; delete what is older, and stale payloads.

        What counts is the checkpoints a load could return, never names alone: the newest
        checkpoints are verified (a checkpoint this object committed or restored is known
        intact and not read again) until ``keep`` intact ones are found, and only
        checkpoints older than the oldest of those are deleted. Unreadable or corrupt
        records newer than that stay where they are (a load skips them), so they can
        never push an intact checkpoint out. With fewer than ``keep`` intact checkpoints
        nothing is deleted. ``keep=0`` deletes every checkpoint.

        Manifests go before their payloads, so a reader never finds a manifest whose
        payload is gone for good. The content objects of format-2 checkpoints are freed
        by :meth:`collect` (which saves run after pruning).

        Returns:
            How many checkpoints were deleted.

        Raises:
            ValueError: ``keep`` is negative.
            CheckpointStoreError: the store failed.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int of at least 0; got {keep!r}")
        return self._catalog.prune(keep)

    def collect(self) -> retention.Collected:
        """Delete content objects that no committed checkpoint references.

        Safe while other processes save to the same run (see :mod:`taskpoint.format.retention`):
        a round is skipped while any save is in flight. Saves collect after pruning.

        Raises:
            CheckpointStoreError: the store failed.
        """
        return self._catalog.collect()

    def delete(self) -> None:
        """Delete everything stored at this checkpoint's URL: checkpoints, markers, status.

        Raises:
            CheckpointStoreError: the store failed.
        """
        self._store.remove_tree()

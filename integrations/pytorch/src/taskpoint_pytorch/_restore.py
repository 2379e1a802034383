"""Restoring a state bundle: every rank loads the newest committed one and they agree.

Every rank first waits for uploads still in flight (rank 0's last commit must land before
any rank looks), then loads the bundle with ``torch.load(weights_only=True)`` and checks it
fits (``_layout``). The ranks then agree they read the same save, or that none was
committed yet, before any object is changed; each rank gets its own RNG state back.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from taskpoint import CheckpointLike
from taskpoint.integration import check_checkpoint_like, gather_or_raise, rank_and_size

from taskpoint_pytorch._agreement import settle_every_rank
from taskpoint_pytorch._components import Components
from taskpoint_pytorch._errors import StateError
from taskpoint_pytorch._layout import read_bundle

__all__ = ["BundleRestorer", "MapLocation"]

log = logging.getLogger(__name__)

MapLocation = str | torch.device | None


class BundleRestorer:
    """The restores of one (not sharded) ``TaskpointState``.

    Args:
        components: the objects restored into.
    """

    def __init__(self, components: Components) -> None:
        self._components = components

    def restore_sync(
        self, checkpoint: CheckpointLike, map_location: MapLocation
    ) -> dict[str, Any] | None:
        """Restore the newest committed bundle (every rank), as
        ``TaskpointState.restore_sync`` describes.

        Returns:
            The bundle restored, or ``None`` when nothing was committed yet.
        """
        settle_every_rank()
        try:
            check_checkpoint_like(checkpoint, "TaskpointState")
            bundle = self._read(checkpoint.load_sync(), map_location)
        except Exception as exc:
            return self._finish(None, exc)
        return self._finish(bundle, None)

    async def restore(
        self, checkpoint: CheckpointLike, map_location: MapLocation
    ) -> dict[str, Any] | None:
        """Async :meth:`restore_sync`: the download is awaited."""
        settle_every_rank()
        try:
            check_checkpoint_like(checkpoint, "TaskpointState")
            bundle = self._read(await checkpoint.load(), map_location)
        except Exception as exc:
            return self._finish(None, exc)
        return self._finish(bundle, None)

    def _read(self, restored: Path | None, map_location: MapLocation) -> dict[str, Any] | None:
        location = map_location if map_location is not None else self._components.device()
        return read_bundle(restored, location, self._components.by_kind(), self._components.rng)

    def _finish(
        self, bundle: dict[str, Any] | None, error: Exception | None
    ) -> dict[str, Any] | None:
        """Every rank: agree on what was read, then load it into the objects.

        Raises:
            Exception: this rank's own error, else :class:`StateError` when another rank
                failed or the ranks read different saves.
        """
        rank, world = rank_and_size()
        summary = None if bundle is None else (bundle["save_id"], bundle["epoch"], bundle["step"])
        summaries = gather_or_raise(summary, error, "restore the state", failure=StateError)
        if any(s != summaries[0] for s in summaries):
            found = ", ".join(
                f"rank {r}: " + ("nothing" if s is None else f"save {s[0]} (epoch {s[1]}, step {s[2]})")
                for r, s in enumerate(summaries)
            )
            raise StateError(
                f"ranks restored different checkpoints ({found}); every rank must read the "
                "same store (a memory:// store is private to its process: use a shared "
                "path or object storage)"
            )
        if bundle is None:
            return None
        self._components.load(bundle, rank, world)
        if rank == 0:
            log.info(
                "restored state bundle saved by %d rank(s): epoch=%d step=%d",
                bundle["world_size"], bundle["epoch"], bundle["step"],
            )
        return bundle

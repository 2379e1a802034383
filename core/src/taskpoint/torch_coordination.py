"""``TorchCoordinator``: the ranks of a ``torch.distributed`` job as a taskpoint coordinator.

In core so that every adapter (``taskpoint_pytorch``, ``taskpoint_hf``,
``taskpoint_lightning``) shares one; ``torch.distributed`` is imported only when a
coordinator is built, so core never depends on torch (``taskpoint_pytorch`` re-exports it).

Example (every rank, after ``torch.distributed.init_process_group``)::

    import taskpoint
    from taskpoint.torch_coordination import TorchCoordinator

    coord = TorchCoordinator(timeout=300)          # a collective: every rank makes one
    ckpt = taskpoint.Checkpoint("s3://bucket/jobs/train-42")
    ckpt.save_part_sync(f"/local/rank-{coord.rank}", coordinator=coord)

It gathers on a gloo group of its own (created with its timeout), so it works beside an
NCCL default group and never waits longer than the timeout: each gather first passes a
``monitored_barrier``, which names the ranks that did not arrive.
"""

from __future__ import annotations

import importlib
import re
from datetime import timedelta
from typing import Any

from taskpoint.coordination import Coordinator, check_timeout
from taskpoint.errors import CheckpointCoordinationError

__all__ = ["TorchCoordinator"]

_MISSING_RE = re.compile(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier")


def _dist() -> Any:
    """``torch.distributed``, imported on first use (core does not depend on torch)."""
    try:
        return importlib.import_module("torch.distributed")
    except ImportError as exc:
        raise RuntimeError(
            "TorchCoordinator needs PyTorch: pip install torch, or use "
            "taskpoint.StoreCoordinator"
        ) from exc


class TorchCoordinator(Coordinator):
    """A :class:`taskpoint.Coordinator` on the default ``torch.distributed`` process group.

    Constructing one is a collective (it creates a gloo group): every rank must.

    Args:
        timeout: default seconds a gather waits for the other ranks (at the start of a
            save, and after each rank's upload).

    Raises:
        RuntimeError: no process group is initialised (use
            :class:`taskpoint.StoreCoordinator` then).
        ValueError: ``timeout`` is not a positive number.
    """

    def __init__(self, *, timeout: float = 600.0) -> None:
        self._timeout = check_timeout(timeout)
        dist = self._dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchCoordinator needs an initialised torch.distributed process group; "
                "without one, use taskpoint.StoreCoordinator"
            )
        self._rank = int(dist.get_rank())
        self._world = int(dist.get_world_size())
        self._group: Any = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=self._timeout)
        ) if self._world > 1 else None

    def __repr__(self) -> str:
        return f"TorchCoordinator(rank={self._rank}, world_size={self._world})"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def all_gather(self, value: Any, *, timeout: float | None = None) -> list[Any]:
        if self._group is None:
            return [value]
        limit = self._timeout if timeout is None else check_timeout(timeout)
        dist = self._dist
        try:
            dist.monitored_barrier(
                group=self._group, timeout=timedelta(seconds=limit), wait_all_ranks=True
            )
            gathered: list[Any] = [None] * self._world
            dist.all_gather_object(gathered, value, group=self._group)
        except RuntimeError as exc:  # DistBackendError and gloo's timeouts
            text = str(exc)
            match = _MISSING_RE.search(text)
            missing = [int(r) for r in re.findall(r"\d+", match.group(1))] if match else []
            who = (
                f"rank(s) {missing} of {self._world} never arrived within {limit:g}s"
                if missing
                else f"another rank failed or did not arrive within {limit:g}s"
            )
            raise CheckpointCoordinationError(
                f"rank {self._rank}: {who} ({text.splitlines()[0] if text else type(exc).__name__})",
                ranks=missing,
            ) from exc
        return list(gathered)

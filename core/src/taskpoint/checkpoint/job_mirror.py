r"""``JobMirror``: a local folder every rank of a job writes, mirrored as one checkpoint.

The framework adapters (``taskpoint_hf``, ``taskpoint_lightning``) mirror a folder the
framework writes (the Trainer's ``output_dir``, Lightning's ``dirpath``). In one process,
or to another system's checkpoint, one rank saves the whole folder through
:attr:`JobMirror.uploads` (a :class:`~taskpoint.checkpoint.mirror.FolderMirror`). With
several processes (a ``torch.distributed`` group of more than one rank) saving to a
:class:`~taskpoint.Checkpoint`, every rank takes part instead: :meth:`JobMirror.join`
finds which ranks share the folder's disk, and each :meth:`JobMirror.save_parts` commits
every disk's share as one checkpoint (see :mod:`taskpoint.distributed.nodes`). The
adapters keep only their framework's hooks::

    job = JobMirror(checkpoint, blocking=None, timeout=600.0)
    job.join(folder)                          # at training start, on every rank
    job.save(folder, step=step, leader=rank == 0)  # in the save hook, once every rank wrote
    job.finish(None, leader=rank == 0)        # at the end of training, on every rank

Two coordinators carry a multi-process mirror's collectives: one for the training thread
(:meth:`save_parts`, :meth:`everywhere`, :meth:`finish`), one for the mirror's upload
thread alone (the multi-writer commit), so the two never interleave on one group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taskpoint._types import CheckpointLike
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.checkpoint.mirror import FolderMirror
from taskpoint.distributed import all_gather_object, current_ranks, is_distributed, nodes
from taskpoint.distributed.torch_coordination import TorchCoordinator

__all__ = ["JobMirror", "Nodes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Nodes:
    """A multi-process job's coordinators (one per thread) and its disks.

    Attributes:
        main: the collectives the training thread makes.
        uploads: the collectives of the multi-writer commit, made on the upload thread.
        disks: which ranks share the mirrored folder's disk.
    """

    main: TorchCoordinator
    uploads: TorchCoordinator
    disks: nodes.Disks


class JobMirror:
    """Mirror a folder every rank writes to ``checkpoint`` (see the module docstring).

    Args:
        checkpoint: where to save: a :class:`~taskpoint.Checkpoint` for a multi-process
            mirror, or any :class:`~taskpoint.CheckpointLike` (then one rank saves alone).
        blocking: as :class:`~taskpoint.checkpoint.mirror.FolderMirror`'s.
        timeout: seconds a rank waits for the others at each step of a save.
    """

    def __init__(
        self, checkpoint: CheckpointLike, *, blocking: bool | None = None, timeout: float = 600.0
    ) -> None:
        self.checkpoint = checkpoint
        self.uploads = FolderMirror(checkpoint, blocking=blocking)
        self.timeout = timeout
        self.nodes: Nodes | None = None
        """Set by :meth:`join` in a multi-process job saving to a ``Checkpoint``."""
        self.lost: BaseException | None = None
        """The last upload failure :meth:`settle` logged (``None``: none)."""

    def join(self, folder: Path) -> Nodes | None:
        """Find the job's ranks and which of them share ``folder``'s disk, once, and remove
        the staging folders a killed process left there. A collective in a multi-process
        job: every rank calls it. ``None`` when one rank saves alone: one process, or a
        checkpoint that is not a :class:`~taskpoint.Checkpoint` (a WARNING on rank 0 says
        the other nodes' own files are then not saved).

        Raises:
            OSError: this rank cannot write into ``folder``.
            CheckpointCoordinationError: another rank could not, or did not arrive in time.
        """
        if self.nodes is not None or not is_distributed():
            return self.nodes
        if not isinstance(self.checkpoint, Checkpoint):
            if current_ranks().rank == 0:
                log.warning(
                    "%r is not a taskpoint.Checkpoint: only rank zero's %s is saved (other "
                    "nodes' own files, such as their RNG states, are not)",
                    self.checkpoint, folder,
                )
            return None
        main = TorchCoordinator(timeout=self.timeout)
        uploads = TorchCoordinator(timeout=self.timeout)  # used by the upload thread only
        disks = nodes.find_disks(main, folder)
        if disks.leads(main.rank):
            nodes.discard_stale_parts(folder)
        log.info(
            "rank %d: %d process(es) write %s on %d disk(s)",
            main.rank, main.world_size, folder, disks.count,
        )
        self.nodes = Nodes(main, uploads, disks)
        return self.nodes

    @property
    def leads(self) -> bool:
        """Whether this rank writes for its disk: it leads the disk of a multi-process
        mirror, or the mirror has no nodes (each rank then has its own say)."""
        return self.nodes is None or self.nodes.disks.leads(self.nodes.main.rank)

    def save_parts(self, folder: Path, *, step: int | None) -> None:
        """Commit every disk's share of ``folder`` as one checkpoint at ``step`` (every
        rank calls this, once all have written their files): finish the previous upload
        (its error, on whichever rank, raised on every rank), stage this rank's part and
        hand it to the upload, which removes it once committed.

        Raises:
            RuntimeError: :meth:`join` found no nodes.
            CheckpointError: the previous upload failed, on any rank, or, when blocking,
                this one did.
            CheckpointCoordinationError: a rank failed to stage, or did not arrive in time.
        """
        ranks = self._nodes()
        nodes.run_everywhere(ranks.main, self.uploads.wait, "finish the previous upload")
        part = nodes.stage_part(ranks.main, folder, ranks.disks)
        if ranks.main.rank == 0:
            log.info("saving %s (step %s) to %r from every node", folder, step, self.checkpoint)
        self.uploads.save_part(part, coordinator=ranks.uploads, step=step, remove=part.parent)

    @property
    def background(self) -> bool:
        """Whether a save's upload goes on after :meth:`save` returns, as the checkpoint's
        own background save, until its commit (one writer, not blocking): a
        :class:`~taskpoint.SaveInterval` then hears of that commit itself."""
        return self.nodes is None and not self.uploads.blocking

    def save(self, folder: Path, *, step: int | None, leader: bool) -> bool:
        """Save ``folder`` at ``step`` once every rank has written its files: in a
        multi-process mirror every disk's share as one checkpoint (:meth:`save_parts`: every
        rank calls this), else the whole folder from ``leader`` (the rank that saves) alone,
        through :attr:`uploads` (in the background unless it blocks), which logs one INFO
        line: the folder, the step, the checkpoint and the seconds the call took.

        Returns:
            Whether this rank took part in a save (``False`` on the ranks that are not
            ``leader`` of a mirror without nodes).

        Raises:
            CheckpointError: the previous upload failed (on every rank of a multi-process
                mirror), or, when blocking, this one did.
            CheckpointCoordinationError: a rank failed to stage its part, or did not arrive
                in time.
        """
        if self.nodes is not None:
            self.save_parts(folder, step=step)
            return True
        if not leader:
            return False
        started = time.monotonic()
        self.uploads.save(folder, step=step)
        log.info(
            "%s %s (step %s) to %r in %.2fs",
            "saved" if self.uploads.blocking else "started saving", folder, step,
            self.checkpoint, time.monotonic() - started,
        )
        return True

    def everywhere(self, action: Callable[[], Any], what: str) -> list[Any]:
        """Run ``action`` on every rank (a collective), each rank's value in rank order;
        one rank's failure fails every rank (see
        :func:`taskpoint.distributed.nodes.run_everywhere`, ``what`` names the step).

        Raises:
            RuntimeError: :meth:`join` found no nodes.
        """
        return nodes.run_everywhere(self._nodes().main, action, what)

    def finish(self, timeout: float | None, *, leader: bool) -> bool:
        """Wait for the last upload at the end of training: on every rank of a
        multi-process mirror (a collective), else on ``leader`` alone (the rank that
        saves); whether it committed within ``timeout`` seconds (``None``: no limit). Where
        it did not, ``leader`` logs a WARNING and training ends without it (the store keeps
        the checkpoint before).

        Raises:
            CheckpointError: it failed (on every rank of a multi-process mirror).
        """
        if self.nodes is not None:
            done = all(nodes.run_everywhere(
                self.nodes.main, lambda: self.uploads.wait(timeout), "finish the last upload"
            ))
        else:
            done = self.uploads.wait(timeout) if leader else True
        if leader and not done:
            log.warning(
                "the upload to %r still runs after %ss; not waiting for it (the store keeps "
                "the checkpoint before)", self.checkpoint, timeout,
            )
        return done

    def release(self) -> None:
        """Training is over: a :class:`~taskpoint.Checkpoint` lets go of its upload process
        (:meth:`taskpoint.Checkpoint.release`; it stays open for a later run, and saves
        already begun still commit); nothing for another system's checkpoint."""
        if isinstance(self.checkpoint, Checkpoint):
            self.checkpoint.release()

    def wait_on_signal(self, timeout: float | None) -> None:
        """A SIGTERM that is not turned into a save: wait for this rank's upload in flight
        at most ``timeout`` seconds; a timeout or its error is logged (the attempt ends
        either way, and the store keeps the checkpoint before)."""
        try:
            if not self.uploads.wait(timeout):
                log.warning(
                    "SIGTERM: the upload to %r still runs after %ss; ending the attempt "
                    "without it (the store keeps the checkpoint before)",
                    self.checkpoint, timeout,
                )
        except Exception as exc:
            log.warning("SIGTERM: the upload to %r failed: %s", self.checkpoint, exc)

    def settle(self, timeout: float | None) -> bool | None:
        """Wait for this rank's upload in flight at most ``timeout`` seconds (``None``: no
        limit), locally (no collective: the adapters call it as training fails or stops):
        ``True`` committed or failed (the failure logged and kept in :attr:`lost`),
        ``False`` still running, ``None`` none in flight."""
        if not self.uploads.uploading:
            return None
        try:
            return self.uploads.wait(timeout)
        except Exception as exc:
            self.lost = exc
            log.warning(
                "the upload to %r failed: %s: %s (the store keeps the checkpoint before)",
                self.checkpoint, type(exc).__name__, exc,
            )
            return True

    def settle_failed(self, exc: BaseException, timeout: float | None, step: int | None) -> None:
        """Training ended by ``exc``: :meth:`settle` this rank's upload in flight (locally:
        the failure may be another rank's death) and log how that went."""
        started = time.monotonic()
        done = self.settle(timeout)
        took, why = time.monotonic() - started, type(exc).__name__
        if done is True:
            log.info(
                "training ended by %s at step %s; the upload in flight committed first "
                "(%.1fs)", why, step, took,
            )
        elif done is False:
            log.warning(
                "training ended by %s at step %s; the upload in flight had not committed "
                "after %.1fs: the store may keep only the checkpoint before it", why, step, took,
            )

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a collective), in rank order: through the mirror's own
        coordinator when it has one, else the default process group's (``[value]``
        without one)."""
        if self.nodes is not None:
            return self.nodes.main.all_gather(value)
        return all_gather_object(value)

    def _nodes(self) -> Nodes:
        if self.nodes is None:
            raise RuntimeError(
                "this JobMirror has no nodes: call join() on every rank of a multi-process "
                "job saving to a taskpoint.Checkpoint first"
            )
        return self.nodes

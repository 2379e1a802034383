"""``TaskpointState``: everything a PyTorch training loop needs back after a crash (the
package's documentation shows a loop), saved as one bundle of plain tensors, numbers and
containers (``_layout``) and restored with ``torch.load(weights_only=True)``. On a
:class:`taskpoint.Checkpoint` the bundle is the one file of a folder the store keeps by
content: a save uploads only the chunks of ``state.pt`` that changed since the last one.

A background save copies the state off the training tensors (to pinned CPU memory from
CUDA) and returns; serialising and uploading run in a thread, one save at a time::

    state = TaskpointState(model, optimizer, blocking=False)
    for epoch in range(start, epochs):
        train_one_epoch(...)
        state.save_sync(checkpoint, epoch=epoch + 1)   # returns once the copy is taken
    state.wait()                                       # the last upload has committed
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from taskpoint import CheckpointLike, IntervalChoice
from taskpoint.integration import BoundarySaves, rank_and_size, track
from torch import nn

from taskpoint_pytorch._bundle import BundleState, MapLocation
from taskpoint_pytorch._components import Components
from taskpoint_pytorch._failure_save import FailureSave

if TYPE_CHECKING:
    from taskpoint_pytorch._sharded import ShardedState

__all__ = ["ResumePoint", "Stateful", "TaskpointState"]

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(...)``: an LR scheduler,
    ``ReduceLROnPlateau``, or your own object."""

    def state_dict(self) -> Any: ...  # pragma: no cover

    def load_state_dict(self, state_dict: Any, /) -> Any: ...  # pragma: no cover


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored loop picks up: the counters and extra state last saved.

    Attributes:
        epoch: the ``epoch`` passed to the save that was restored.
        step: the ``step`` passed to that save.
        extra: the ``extra`` mapping passed to that save (tensors mapped to the restore
            device); empty when none was given.
    """

    epoch: int
    step: int
    extra: dict[str, Any] = field(default_factory=dict)


class TaskpointState:
    """The state a training loop must get back to resume exactly, saved as one bundle.

    Each object argument takes one object, stored under the default name (``"model"``,
    ``"optimizer"``, ``"scheduler"``, ``"scaler"``), or a mapping of names to objects for
    several (a GAN's generator and discriminator, say). Restoring needs a state built with
    the same names.

    Args:
        model: the model(s). A ``DistributedDataParallel``, ``DataParallel`` or
            ``torch.compile`` wrapper is unwrapped, so the bundle resumes with or without it.
        optimizer: the optimizer(s).
        scheduler: LR scheduler(s), or anything with ``state_dict``/``load_state_dict``.
        scaler: AMP ``torch.amp.GradScaler``(s).
        generators: named ``torch.Generator`` objects of your own (a ``DataLoader``'s
            ``generator=``), saved and restored beside the global ones.
        rng: save and restore the global RNGs (Python ``random``, NumPy's legacy global
            generator, torch CPU, every initialised CUDA device). Without them a resumed run
            draws different shuffles, dropout masks and augmentations than an uninterrupted one.
        sharded: save models and optimizers sharded, through ``torch.distributed.checkpoint``
            (FSDP2 and other ``DTensor`` state): every rank writes its own shards, no rank
            ever holds the whole state, and one taskpoint commit covers every rank's files.
            The checkpoint must be a :class:`taskpoint.Checkpoint`; it restores on any
            number of ranks (DCP reshards); RNG states stay per rank. Saves are blocking.
        blocking: whether ``save``/``save_sync`` wait for the commit by default (each call's
            ``background=`` overrides it). A background save copies the state (to pinned
            CPU memory from CUDA, with non-blocking copies and one stream sync per device),
            returns, and serialises and uploads it in a thread; the next save waits for it
            only while it still runs. Its error is raised by the next save or
            :meth:`wait`. Restoring first waits for uploads still in flight.
        save_on_preemption: whether a SIGTERM becomes a save at the next ``save_sync``
            call (see :meth:`save_sync`); ``None``: ``TASKPOINT_SAVE_ON_PREEMPTION``, else
            inside a taskpoint task. An upload in flight when the attempt ends (the loop
            raised) is waited for first, up to a minute or the grace period left.
        save_on_exception: when an exception ends the attempt (the task raised, or it
            ends a process of the environment contract), save the state as it was at the
            last ``save_sync`` call, if that call did not save and nothing has changed it
            since (no optimizer stepped, no parameter or buffer was written): the retry
            then resumes at that step, not at the last save. A blocking save at the
            failure; not under ``torch.distributed`` nor with ``sharded``. Each call then
            also notes the RNG and scheduler states and sums the tensors' version counters.

    Raises:
        TypeError: an object of the wrong kind.
        ValueError: an empty or non-string name in a mapping, or ``sharded`` with
            ``blocking=False`` or ``save_on_exception``.
    """

    def __init__(
        self,
        model: nn.Module | Mapping[str, nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
        scheduler: Stateful | Mapping[str, Stateful] | None = None,
        scaler: torch.amp.GradScaler | Mapping[str, torch.amp.GradScaler] | None = None,
        *,
        generators: Mapping[str, torch.Generator] | None = None,
        rng: bool = True,
        blocking: bool = True,
        sharded: bool = False,
        save_on_preemption: bool | None = None,
        save_on_exception: bool = False,
    ) -> None:
        self._components = Components(model, optimizer, scheduler, scaler, generators, rng)
        if sharded and not blocking:
            raise ValueError("sharded=True saves are blocking: pass blocking=True")
        if sharded and save_on_exception:
            raise ValueError(
                "save_on_exception=True needs every rank to save, which a failing rank "
                "cannot ask of the others: pass sharded=False or save_on_exception=False"
            )
        self._preemption = BoundarySaves(
            save_on_preemption, size=self._components.state_bytes, thread="taskpoint-state-upload"
        )
        uploads = self._preemption.uploads
        self._state: BundleState | ShardedState
        if sharded:  # imports torch.distributed.checkpoint, which only sharded saves need
            from taskpoint_pytorch._sharded import ShardedState

            self._state = ShardedState(self._components)
        else:
            self._state = BundleState(self._components, blocking=bool(blocking), uploads=uploads)
        track(uploads)
        self._failure = FailureSave(self._components, self._commit) if save_on_exception else None

    def __repr__(self) -> str:
        parts = ", ".join(f"{kind}={names}" for kind, names in self.layout().items())
        return f"TaskpointState({parts}, rng={self._components.rng})"

    def layout(self) -> dict[str, list[str]]:
        """The component names per kind, as a bundle records them (for messages and tests)."""
        return {kind: sorted(objects) for kind, objects in self._components.by_kind().items()}

    # -- saving -----------------------------------------------------------------------

    def save_sync(
        self,
        checkpoint: CheckpointLike,
        *,
        epoch: int = 0,
        step: int = 0,
        extra: Mapping[str, Any] | None = None,
        background: bool | None = None,
        every: int | None = None,
        every_s: float | Literal["auto"] | None = None,
    ) -> bool:
        """Commit the current state to ``checkpoint``, blocking until it is durable.

        Each call is a step boundary: the loop's counter (``step``, else ``epoch``) is
        reported (:func:`taskpoint.report_step`), and when SIGTERM becomes a save (the
        state's ``save_on_preemption``) a signal that reached any rank since the last
        call makes this call save at once, wait for the commit within the grace period
        left, and raise :class:`taskpoint.Preempted`: the next attempt resumes at this
        step. A loop that saves every N steps calls it at every step with ``every=N``; one
        that saves every N seconds of training (or as often as ``"auto"`` finds best), with
        ``every_s=N``. Given both, it saves when either says so.

        Args:
            checkpoint: a :class:`taskpoint.Checkpoint` or any ``CheckpointLike``.
            epoch: your epoch counter; returned as is by restore. The examples store the
                next epoch to run, so a loop resumes with ``range(resume.epoch, epochs)``.
            step: your step counter (e.g. optimizer steps done so far).
            extra: more state to keep: tensors, numbers, strings, bytes, None, and lists,
                tuples and dicts of them (str keys at the top).
            background: copy the state and return; serialise and upload it in a background
                thread (``None``: the opposite of the state's ``blocking``). A save while the
                previous background save still runs waits for it first.
            every: save only when the counter is a multiple of ``every`` (or on a
                preemption); ``None``: save now, unless ``every_s`` is given.
            every_s: save once this many seconds of training passed since the last save
                (any save), or ``"auto"``: the Young/Daly interval from the measured cost of
                a save and the run's mean time between failures
                (:class:`taskpoint.SaveInterval`). Each call times the step, so call it at
                every step; under ``torch.distributed`` rank 0's clock decides for every
                rank. A SIGTERM saves anyway: the interval is for failures without warning.

        Returns:
            Whether it saved (``False``: ``every``/``every_s`` said not yet).

        Under ``torch.distributed`` every rank must call this; only global rank 0 writes,
        and every rank returns once the commit is done (a background save: once rank 0
        has copied the state; a failed upload then fails every rank's next save).

        Raises:
            TypeError: ``checkpoint`` is not checkpoint-like, or a value (in ``extra``, a
                model's extra state, ...) would not load with ``weights_only=True``.
            ValueError: a negative or non-int counter, ``every`` below 1, or ``every_s``
                not a positive number of seconds or ``"auto"``.
            taskpoint.CheckpointError: the store failed (on rank 0; this save's, or a
                background save's before it), or :class:`StateError` on the other ranks
                when rank 0 failed.
            taskpoint.Preempted: a rank received SIGTERM; the preemption save committed,
                failed (chained) or could not fit in the grace period left (none made).
        """
        if self._failure is not None:
            self._failure.note(checkpoint, epoch, step, extra)
        turn = self._preemption.reached(checkpoint, step or epoch, every, every_s)
        if not turn.save:
            return False
        with turn:
            self._commit(checkpoint, epoch, step, extra, background)
        if self._failure is not None:
            self._failure.saved()
        return True

    async def save(
        self,
        checkpoint: CheckpointLike,
        *,
        epoch: int = 0,
        step: int = 0,
        extra: Mapping[str, Any] | None = None,
        background: bool | None = None,
        every: int | None = None,
        every_s: float | Literal["auto"] | None = None,
    ) -> bool:
        """Async :meth:`save_sync`: the upload is awaited; serialisation, and under
        ``torch.distributed`` the collectives, run on the calling thread. A background save
        returns once the copy is taken, as :meth:`save_sync`'s does."""
        if self._failure is not None:
            self._failure.note(checkpoint, epoch, step, extra)
        turn = self._preemption.reached(checkpoint, step or epoch, every, every_s)
        if not turn.save:
            return False
        with turn, self._state.saving(checkpoint, epoch, step, extra, background) as target:
            if target is not None:
                await checkpoint.save(target)
        if self._failure is not None:
            self._failure.saved()
        return True

    def _commit(
        self, checkpoint: CheckpointLike, epoch: int, step: int,
        extra: Mapping[str, Any] | None, background: bool | None = False,
    ) -> None:
        """Save the current state (blocking unless ``background`` says otherwise): a
        :meth:`save_sync` whose turn came, and the save at a failure
        (:mod:`taskpoint_pytorch._failure_save`), which is blocking."""
        with self._state.saving(checkpoint, epoch, step, extra, background) as target:
            if target is not None:
                checkpoint.save_sync(target)

    @property
    def save_interval(self) -> IntervalChoice | None:
        """The time interval ``every_s`` asked for, and for ``"auto"`` what it was chosen
        from (:class:`taskpoint.IntervalChoice`; its ``metrics()`` are ``taskpoint/*``
        figures for a logger); ``None`` before a call with ``every_s``. Local to this
        rank: rank 0's decides."""
        return self._preemption.interval_choice

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background save in flight (if any) has committed.

        The newest goes first: when a save waits behind the one uploading, that upload
        stops, uncommitted (counted as coalesced), and the newer save uploads at once,
        under the checkpoint's ``when_busy="coalesce"``; under ``"wait"`` both commit, in
        order. The interpreter's exit waits the same way, except after a preemption
        signal. Local to the calling process: under ``torch.distributed`` only rank 0 has
        uploads.

        Args:
            timeout: give up after this many seconds (``None``: no limit).

        Returns:
            ``True`` once no upload runs; ``False`` if ``timeout`` ran out first.

        Raises:
            taskpoint.CheckpointError: the background save failed (raised once).
        """
        return self._preemption.uploads.wait(timeout)

    # -- restoring --------------------------------------------------------------------

    def restore_sync(
        self, checkpoint: CheckpointLike, *, map_location: MapLocation = None
    ) -> ResumePoint | None:
        """Restore the newest committed bundle into the objects; where to resume.

        Args:
            checkpoint: a :class:`taskpoint.Checkpoint` or any ``CheckpointLike``.
            map_location: where tensors load to; by default the device of the first
                model's first parameter (CPU without one), so a GPU checkpoint resumes on
                CPU and the reverse. Optimizer state follows its parameters' devices.

        Returns:
            The saved counters and extra state, or ``None`` when nothing was committed yet
            (the first attempt): then nothing is changed.

        Under ``torch.distributed`` every rank must call this; all restore the same bundle,
        each its own rank's RNG state.

        Raises:
            StateLayoutError: the checkpoint is not a bundle of this layout (a plain
                ``torch.save`` file, a newer version, other component names).
            StateMismatchError: a model's parameter names or shapes, or an optimizer's
                parameter groups, differ from the checkpoint's; names the keys.
            StateError: ranks restored different checkpoints, or another rank failed.
            taskpoint.CheckpointError: the store failed or holds no intact checkpoint.
        """
        return self._resumed(self._state.restore_sync(checkpoint, map_location))

    async def restore(
        self, checkpoint: CheckpointLike, *, map_location: MapLocation = None
    ) -> ResumePoint | None:
        """Async :meth:`restore_sync`: the download is awaited."""
        return self._resumed(await self._state.restore(checkpoint, map_location))

    def _resumed(self, bundle: dict[str, Any] | None) -> ResumePoint | None:
        """Training resumes from ``bundle`` (every rank; ``None``: from scratch): log it
        (rank 0), begin the step boundaries there; where the loop resumes."""
        rank, world = rank_and_size()
        if bundle is None:
            if rank == 0:
                log.info("no state committed yet: starting from scratch")
            self._preemption.begin(0)
            return None
        if rank == 0:
            log.info(
                "restored state saved by %d rank(s) on %d: epoch=%d step=%d",
                bundle["world_size"], world, bundle["epoch"], bundle["step"],
            )
        self._preemption.begin(bundle["step"] or bundle["epoch"])
        return ResumePoint(epoch=bundle["epoch"], step=bundle["step"], extra=dict(bundle["extra"]))

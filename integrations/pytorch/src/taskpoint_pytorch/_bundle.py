"""A state bundle (``TaskpointState`` without ``sharded``) through a ``CheckpointLike``:
global rank 0 writes one ``torch.save`` file and commits it; every rank restores it.

Saving: every rank first agrees to save (its counters, ``extra`` and RNG state gathered; see
``_agreement``); rank 0 then builds the bundle, checks it loads with ``weights_only=True``
and writes :data:`~taskpoint_pytorch._layout.STATE_FILE` to a private temporary folder,
which the checkpoint commits; then rank 0 tells every rank how the commit went. A
background save copies the bundle off the training tensors instead (:func:`cpu_copy`) and
serialises and commits it in the state's upload thread. The file is written without the
zip format's CRC-32 of each record (:func:`_write`): ``torch.load`` never checks it, the
checkpoint's own checksums cover every byte, and computing it took most of the write
(200 MB: 0.06 s without it, 0.18-0.63 s with it).

Restoring: every rank first waits for uploads still in flight (rank 0's last commit must
land before any rank looks), then loads the bundle with ``torch.load(weights_only=True)``
and checks it fits (``_layout``). The ranks then agree they read the same save, or that
none was committed yet, before any object is changed; each rank gets its own RNG state.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from taskpoint import Checkpoint, CheckpointLike
from taskpoint.integration import (
    UploadThread,
    broadcast_from_zero,
    check_checkpoint_like,
    describe_error,
    gather_or_raise,
    make_way,
    note_coalesced,
    rank_and_size,
    remove_scratch_folder,
    scratch_folder,
    stores_by_content,
)

from taskpoint_pytorch._agreement import agree_to_save, settle_every_rank
from taskpoint_pytorch._components import Components, tensors_in
from taskpoint_pytorch._errors import StateError, StateLayoutError
from taskpoint_pytorch._layout import STATE_FILE, check_fit, check_layout

__all__ = ["BundleState", "MapLocation", "cpu_copy"]

log = logging.getLogger(__name__)

MapLocation = str | torch.device | None


class BundleState:
    """The saves and restores of one (not sharded) ``TaskpointState``.

    Args:
        components: the objects saved and restored.
        blocking: whether a save waits for its commit when the call does not say.
        uploads: the state's upload thread, which runs background saves one at a time.
    """

    def __init__(self, components: Components, *, blocking: bool, uploads: UploadThread) -> None:
        self._components = components
        self._blocking = blocking
        self._uploads = uploads
        # Host tensors of background saves' copies, kept for the next copies once serialised
        # (or dropped): at most two sets, what a running save, one waiting behind it and a
        # new copy use at once. The upload thread gives them back (a deque is thread-safe).
        self._free: collections.deque[list[torch.Tensor]] = collections.deque(maxlen=2)

    @contextlib.contextmanager
    def saving(
        self, checkpoint: CheckpointLike, epoch: int, step: int,
        extra: Mapping[str, Any] | None, background: bool | None,
    ) -> Iterator[Path | None]:
        """One save on every rank (as ``TaskpointState.save_sync`` and the module
        describe), around its upload: yields what rank 0 hands ``checkpoint`` to commit
        (the bundle file, or its folder: :func:`_upload_target`), or ``None`` (another
        rank, a bundle that could not be built, a background save). An ``Exception`` the
        body raises is the commit's failure; every rank then raises (:class:`StateError`
        on the other ranks) and the file goes.

        Rank 0 first raises what a finished background save raised (its failure fails the
        save on every rank); any save when the checkpoint's ``when_busy`` is ``"wait"``
        first waits for the background save in flight, and a blocking save otherwise until
        that one has been handed to a :class:`taskpoint.Checkpoint`, whose newer blocking
        save stops its upload (another checkpoint's: until it is done).
        """
        rank, world = rank_and_size()
        copy = not self._blocking if background is None else bool(background)

        def prepare() -> None:
            if rank == 0:
                coalesce = getattr(checkpoint, "when_busy", "coalesce") == "coalesce"
                if not coalesce:
                    self._uploads.wait()
                elif not copy:  # a save handed to the checkpoint: this one stops it there
                    self._uploads.wait_handed()
                self._uploads.raise_error()
            check_checkpoint_like(checkpoint, "TaskpointState")

        extra_state, rng_states = agree_to_save(
            prepare, epoch, step, extra, self._components.rng
        )
        error: Exception | None = None
        path: Path | None = None
        if rank == 0:
            try:
                bundle = self._components.bundle(epoch, step, extra_state, rng_states, world)
                if copy:
                    reuse = self._free.pop() if self._free else []
                    self._queue(checkpoint, *cpu_copy(bundle, reuse))
                else:
                    path = _serialise(bundle)
            except Exception as exc:
                error = exc
        try:
            try:
                yield None if path is None else _upload_target(checkpoint, path)
            except Exception as exc:
                error = exc
            outcome = broadcast_from_zero(describe_error(error) if rank == 0 else None)
            if error is not None:
                raise error
            if outcome is not None:
                raise StateError(
                    f"rank 0 failed to save the checkpoint ({outcome}), so rank {rank} stops too"
                )
        finally:
            if path is not None:
                _discard(path)

    def _queue(
        self, checkpoint: CheckpointLike, bundle: dict[str, Any], buffers: list[torch.Tensor]
    ) -> None:
        """Serialise and commit ``bundle`` (a private copy) in the upload thread; its host
        tensors ``buffers`` are kept for a later copy once it is serialised or dropped."""

        def write() -> None:
            try:
                path = _serialise(bundle)
            finally:  # serialised (or failed): the next copy may write into them
                self._free.append(buffers)
            try:
                if isinstance(checkpoint, Checkpoint):
                    # Its upload process (or thread) sends it, off this process's GIL.
                    target = _upload_target(checkpoint, path)
                    checkpoint.save_sync(target, background=True, snapshot="link")
                    # A newer blocking save stops it there; so does a wait, for a newer
                    # save queued behind this one.
                    self._uploads.hand_over(stop=lambda: make_way(checkpoint))
                else:
                    checkpoint.save_sync(path)
            finally:  # the snapshot holds it now: a process killed during the upload
                _discard(path)  # leaves no second copy
            if isinstance(checkpoint, Checkpoint):
                checkpoint.wait()

        # Behind an upload in flight it waits, replacing (coalescing) one waiting there.
        if self._uploads.start(write, on_drop=lambda: self._free.append(buffers)):
            note_coalesced(checkpoint)

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
        """Load the bundle a restore brought back and check it fits the components.

        Args:
            restored: the restored file, or a directory holding :data:`STATE_FILE`; ``None``
                when nothing was committed (returned as is).
            map_location: where tensors load to (``torch.load``'s); ``None``: the
                components' device.

        Raises:
            StateLayoutError: the file is missing, does not load with ``torch.load(...,
                weights_only=True)`` (which never executes pickled code), or is not a
                bundle of this layout with these component names
                (``_layout.check_layout``).
            StateMismatchError: a model's or optimizer's shape differs
                (``_layout.check_fit``).
        """
        if restored is None:
            return None
        path = Path(restored)
        file = path / STATE_FILE if path.is_dir() else path
        if not file.is_file():
            raise StateLayoutError(
                f"the checkpoint restored to {str(path)!r} is a directory without "
                f"{STATE_FILE!r}: it was not saved by TaskpointState"
            )
        location = map_location if map_location is not None else self._components.device()
        try:
            bundle = torch.load(file, map_location=location, weights_only=True)
        except Exception as exc:
            raise StateLayoutError(
                f"cannot load {str(file)!r} with torch.load(weights_only=True) "
                f"({type(exc).__name__}, details in the chained exception): it is not a state "
                "bundle written by TaskpointState, and restoring never unpickles other objects"
            ) from exc
        parts = self._components.by_kind()
        check_layout(bundle, str(file), parts, self._components.rng)
        check_fit(bundle, parts)
        return cast(dict[str, Any], bundle)

    def _finish(
        self, bundle: dict[str, Any] | None, error: Exception | None
    ) -> dict[str, Any] | None:
        """Every rank: agree on what was read, then load it into the objects.

        Raises:
            Exception: this rank's own error, else :class:`StateError` when another rank
                failed or the ranks read different saves.
        """
        rank, world = rank_and_size()
        summary = None if bundle is None else (
            f"save {bundle['save_id']} (epoch {bundle['epoch']}, step {bundle['step']})"
        )
        summaries = gather_or_raise(summary, error, "restore the state", failure=StateError)
        if any(s != summaries[0] for s in summaries):
            found = ", ".join(f"rank {r}: {s or 'nothing'}" for r, s in enumerate(summaries))
            raise StateError(
                f"ranks restored different checkpoints ({found}); every rank must read the "
                "same store (a memory:// store is private to its process: use a shared "
                "path or object storage)"
            )
        if bundle is None:
            return None
        self._components.load(bundle, rank, world)
        return bundle


def cpu_copy(value: Any, into: Sequence[torch.Tensor] = ()) -> tuple[Any, list[torch.Tensor]]:
    """A copy of ``value`` whose tensors are private CPU tensors, taken now.

    CUDA tensors go to pinned memory with non-blocking copies, then each device's current
    stream is synchronised once; a tensor appearing twice is copied once.

    Args:
        value: the bundle (tensors in dicts, lists, tuples and sets; other leaves are
            deep-copied).
        into: host tensors of an earlier copy that nothing uses any more: where every
            tensor matches (same order, shapes and dtypes, pinned for CUDA sources) the
            copy is written into them. Memory already touched takes a copy several times
            faster than fresh memory, which page-faults on the first write (200 MB: about
            0.2 s against 1 s on a 2-core machine); this is the time training waits.

    Returns:
        The copy, and its tensors in order (what a later call may pass as ``into``).
    """
    sources = {id(tensor): tensor.detach() for tensor in tensors_in(value)}
    tensors = list(sources.values())
    reuse = len(into) == len(tensors) and all(
        _fits(buffer, tensor) for buffer, tensor in zip(into, tensors, strict=True)
    )
    devices: set[torch.device] = set()
    copies: list[torch.Tensor] = []
    for index, tensor in enumerate(tensors):
        on_cuda = tensor.device.type == "cuda" and tensor.layout == torch.strided
        if reuse:
            out = into[index]
            out.copy_(tensor, non_blocking=on_cuda)
        elif on_cuda:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            out.copy_(tensor, non_blocking=True)
        else:
            out = tensor.to("cpu", copy=True)
        if on_cuda:
            devices.add(tensor.device)
        copies.append(out)
    # Each tensor (by identity) becomes its copy; the rest is deep-copied around them.
    copied = copy.deepcopy(value, dict(zip(sources, copies, strict=True)))
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return copied, copies


def _fits(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be copied into ``buffer`` as :func:`cpu_copy` would copy it."""
    return (
        tensor.layout == torch.strided and buffer.device.type == "cpu"
        and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype
        and buffer.is_contiguous() and (tensor.device.type != "cuda" or buffer.is_pinned())
    )


def _upload_target(checkpoint: object, path: Path) -> Path:
    """What a save hands to ``checkpoint``: for a :class:`taskpoint.Checkpoint` that stores
    folders by content (store format 2, the default), the folder holding the bundle, so a
    save uploads only the chunks of ``state.pt`` that changed since the last one (a
    restore finds the bundle in the folder); else the bundle file itself."""
    return path.parent if stores_by_content(checkpoint) else path


def _serialise(bundle: dict[str, Any]) -> Path:
    """``bundle`` written to :data:`STATE_FILE` in a ``bundle`` folder of a new scratch
    folder, which the caller removes (:func:`_discard`; a process killed first leaves it to
    the next process's sweep); removed here if writing fails. The folder saved is the
    ``bundle`` folder, which holds nothing else: the scratch folder's own ``.owner`` file
    stays out of the checkpoint."""
    began = time.monotonic()
    folder = scratch_folder() / "bundle"
    try:
        folder.mkdir()
        _write(bundle, folder / STATE_FILE)
    except BaseException:
        remove_scratch_folder(folder.parent)
        raise
    log.debug("serialised state bundle (epoch=%d, step=%d, %d bytes) in %.3f s in %s",
              bundle["epoch"], bundle["step"], (folder / STATE_FILE).stat().st_size,
              time.monotonic() - began, threading.current_thread().name)
    return folder / STATE_FILE


_CRC_SWITCH = threading.Lock()
"""Held while :func:`_write` has ``torch.save``'s process-wide CRC-32 switch off."""


def _write(bundle: dict[str, Any], path: Path) -> None:
    """``torch.save(bundle, path)`` without the CRC-32 of each zip record (where torch has
    the switch, 2.6 and later). ``torch.load`` reads the file as always; a zip tool reports
    the CRCs as wrong. The switch is process-wide: a ``torch.save`` that another thread
    makes meanwhile writes no CRCs either, and loads as well."""
    set_crc32 = getattr(torch.serialization, "set_crc32_options", None)
    get_crc32 = getattr(torch.serialization, "get_crc32_options", None)
    if set_crc32 is None or get_crc32 is None:
        torch.save(bundle, path)
        return
    with _CRC_SWITCH:
        before = get_crc32()
        set_crc32(False)
        try:
            torch.save(bundle, path)
        finally:
            set_crc32(before)


def _discard(path: Path) -> None:
    """Remove the scratch folder :func:`_serialise` wrote ``path`` into. Never fails."""
    remove_scratch_folder(path.parent.parent)

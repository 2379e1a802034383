"""``TaskpointSklearnCheckpoint``: save a :class:`PartialFitBundle` after each chunk,
restore it on the next attempt (the package's documentation shows a loop).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from taskpoint import CheckpointError, CheckpointLike, IntervalChoice
from taskpoint.integration import (
    BoundarySaves,
    FailureHook,
    Turn,
    check_checkpoint_like,
    remove_scratch_folder,
    scratch_folder,
)

from taskpoint_sklearn.bundle import PartialFitBundle
from taskpoint_sklearn.errors import BundleFormatError
from taskpoint_sklearn.formats import (
    DEFAULT_TRUSTED_TYPES,
    FORMATS,
    Format,
    decode,
    encode,
    filename_for,
    type_names,
)

__all__ = ["TaskpointSklearnCheckpoint"]

log = logging.getLogger(__name__)


class TaskpointSklearnCheckpoint:
    """Saves and restores :class:`PartialFitBundle` s through any taskpoint-style checkpoint.

    Args:
        checkpoint: where bundles go: ``taskpoint.ctx().checkpoint``, a
            ``taskpoint.Checkpoint``, or any object with the same methods (Flyte's).
        format: ``"skops"`` (default): restoring constructs only trusted types and runs no
            code from the file. ``"pickle"`` or ``"joblib"``: opt-in, for estimators skops
            cannot represent; restoring runs code from the checkpoint, so use them only
            with a store that nobody untrusted can write to.
        trusted: extra types (names like ``"mypkg.MyTransformer"`` or the types) a skops
            bundle may hold, on top of skops' defaults and :data:`DEFAULT_TRUSTED_TYPES`.
        filename: the bundle's file name in the checkpoint, without the suffix.
        save_on_preemption: whether a SIGTERM becomes a save at the next :meth:`save_sync`
            (the next chunk): the loop then stops there with :class:`taskpoint.Preempted`
            and the next attempt resumes at that chunk. ``None``:
            ``TASKPOINT_SAVE_ON_PREEMPTION``, else inside a taskpoint task.
        save_on_exception: when an exception ends the attempt (inside a taskpoint task or
            a process of the environment contract), save the bundle as it was at the last
            :meth:`save_sync` call that did not save (``every``/``every_s`` said not yet),
            so the retry resumes at that chunk. Costs a copy of the bundle at each such
            call.

    Raises:
        TypeError: ``checkpoint`` lacks the checkpoint methods (``None`` outside a task,
            for one), ``trusted`` holds something that is not a type or a name, or
            ``save_on_exception`` is not a bool.
        ValueError: ``format`` or ``filename`` is not accepted.
    """

    def __init__(
        self,
        checkpoint: CheckpointLike,
        *,
        format: Format = "skops",
        trusted: Iterable[str | type] = (),
        filename: str = "sklearn-bundle",
        save_on_preemption: bool | None = None,
        save_on_exception: bool = False,
    ) -> None:
        check_checkpoint_like(checkpoint, type(self).__name__)
        if not isinstance(save_on_exception, bool):
            raise TypeError(f"save_on_exception must be True or False; got {save_on_exception!r}")
        if format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}; got {format!r}")
        if not isinstance(filename, str) or not filename or "/" in filename or "\\" in filename:
            raise ValueError(f"filename must be a non-empty name without slashes; got {filename!r}")
        self._checkpoint = checkpoint
        self._format: Format = format
        self._allowed = DEFAULT_TRUSTED_TYPES | type_names(trusted)
        self._filename = filename_for(format, filename)
        self._saves = BoundarySaves(save_on_preemption, ranks=False, unit="chunks")
        self._failure = (
            FailureHook(self._at_failure, "save_on_exception=True") if save_on_exception else None
        )
        self._unsaved: PartialFitBundle | None = None  # the last call's bundle, not saved

    def __repr__(self) -> str:
        return f"TaskpointSklearnCheckpoint({self._checkpoint!r}, format={self._format!r})"

    @property
    def format(self) -> str:
        """The format bundles are saved in."""
        return self._format

    @property
    def trusted(self) -> frozenset[str]:
        """Every type name a skops bundle may hold beyond skops' own defaults."""
        return self._allowed

    # -- saving -----------------------------------------------------------------------

    def save_sync(
        self,
        bundle: PartialFitBundle,
        *,
        every: int | None = None,
        every_s: float | Literal["auto"] | None = None,
    ) -> bool:
        """Commit ``bundle`` as the newest checkpoint, blocking until it is durable.

        The bundle is serialised before this returns, so it is a snapshot: training may
        continue right after.

        Each call is a step boundary: ``bundle.progress`` is reported
        (:func:`taskpoint.report_step`), and when SIGTERM becomes a save
        (``save_on_preemption``) a signal received since the last call makes this call
        save at once and raise :class:`taskpoint.Preempted` once it committed; the next
        attempt resumes at this chunk. A save that took longer last time than the grace
        period left is skipped (the newest earlier checkpoint stays). Given ``every`` and
        ``every_s``, it saves when either says so.

        Args:
            bundle: the bundle, its ``progress`` set for the chunk just done.
            every: save only when ``bundle.progress`` is a multiple of ``every`` (or on a
                preemption); ``None``: save now, unless ``every_s`` is given.
            every_s: save once this many seconds of training passed since the last save,
                or ``"auto"``: the Young/Daly interval from the measured cost of a save and
                the run's mean time between failures (:class:`taskpoint.SaveInterval`).
                Each call times the chunk, so call it after every chunk. A SIGTERM saves
                anyway: the interval is for failures without warning.

        Returns:
            Whether it saved (``False``: ``every``/``every_s`` said not yet).

        Raises:
            TypeError: ``bundle`` is not a :class:`PartialFitBundle`, or holds an object
                the format cannot represent.
            ValueError: ``every`` is not a positive int, or ``every_s`` not a positive
                number of seconds or ``"auto"``.
            UntrustedTypesError: a skops bundle holds a type a restore would refuse
                (nothing is saved; pass it in ``trusted`` if you trust it).
            taskpoint.CheckpointError: the store failed.
            taskpoint.Preempted: SIGTERM arrived; the save committed, failed (chained) or
                did not fit in the grace period left (none made).
        """
        turn = self._turn(bundle, every, every_s)
        if not turn.save:
            return False
        with turn, self._staged(bundle) as path:
            self._checkpoint.save_sync(path)
        return True

    def _at_failure(self, exc: BaseException) -> None:
        """``exc`` ends the attempt: save the bundle of the last call that did not save
        (``save_on_exception``). Logs what it did; raises nothing."""
        bundle, self._unsaved = self._unsaved, None
        if bundle is None:
            return
        if isinstance(exc, CheckpointError):
            log.warning(
                "no save at the failure (%s): the checkpoint store failed, and would fail "
                "this save too; the retry resumes at the last committed save",
                type(exc).__name__,
            )
            return
        try:
            with self._staged(bundle) as path:
                self._checkpoint.save_sync(path)
        except Exception as error:
            log.warning("the save at the failure (%s) failed: %s: %s",
                        type(exc).__name__, type(error).__name__, error)
            return
        log.warning("saved the bundle of progress %d at the failure (%s): the retry resumes "
                    "there", bundle.progress, type(exc).__name__)

    async def save(
        self,
        bundle: PartialFitBundle,
        *,
        every: int | None = None,
        every_s: float | Literal["auto"] | None = None,
    ) -> bool:
        """Async :meth:`save_sync`: serialises now, then awaits the checkpoint's upload."""
        turn = self._turn(bundle, every, every_s)
        if not turn.save:
            return False
        with turn, self._staged(bundle) as path:
            await self._checkpoint.save(path)
        return True

    @property
    def save_interval(self) -> IntervalChoice | None:
        """The time interval ``every_s`` asked for, and for ``"auto"`` what it was chosen
        from (:class:`taskpoint.IntervalChoice`); ``None`` before a call with ``every_s``."""
        return self._saves.interval_choice

    def _turn(
        self, bundle: PartialFitBundle, every: int | None,
        every_s: float | Literal["auto"] | None,
    ) -> Turn:
        """What a save call does (see :meth:`BoundarySaves.reached`); with
        ``save_on_exception``, a copy of a bundle this call does not save is kept for a
        save at a failure."""
        if not isinstance(bundle, PartialFitBundle):
            raise TypeError(f"save() takes a PartialFitBundle; got {type(bundle).__name__}")
        turn = self._saves.reached(self._checkpoint, bundle.progress, every, every_s)
        if self._failure is not None:
            self._unsaved = None
            if self._failure.follow(stacklevel=3) and not turn.save:
                self._unsaved = copy.deepcopy(bundle)
        return turn

    @contextlib.contextmanager
    def _staged(self, bundle: PartialFitBundle) -> Iterator[Path]:
        """The bundle serialised to a file in a scratch folder, for the body to commit; the
        folder goes when the body ends (or with the next process's sweep, if this process
        is killed first)."""
        started = time.monotonic()
        data = encode(bundle.to_payload(), self._format, self._allowed)
        folder = scratch_folder()
        try:
            path = folder / self._filename
            path.write_bytes(data)
            yield path
        finally:
            remove_scratch_folder(folder)
        log.debug(
            "saved %s bundle of %s at progress %d (%d bytes) in %.2fs", self._format,
            type(bundle.estimator).__name__, bundle.progress, len(data), time.monotonic() - started,
        )

    # -- loading ----------------------------------------------------------------------

    def _decode(self, path: Path | None) -> PartialFitBundle | None:
        if path is None:
            return None
        path = Path(path)
        if not path.is_file():
            raise BundleFormatError(
                f"the checkpoint restored to {str(path)!r}, which is not a single file: it was "
                "not saved by TaskpointSklearnCheckpoint",
                path=str(path),
            )
        payload = decode(path, self._format, self._allowed)
        bundle = PartialFitBundle.from_payload(payload, source=str(path))
        log.info(
            "restored %s at progress %d from %s",
            type(bundle.estimator).__name__, bundle.progress, path,
        )
        return bundle

    def load_sync(self) -> PartialFitBundle | None:
        """The newest saved bundle, or ``None`` when nothing was saved yet.

        Raises:
            UntrustedTypesError: the skops bundle holds a type outside the trusted list;
                the message names it, and nothing from the file was constructed.
            BundleFormatError: the checkpoint is not a bundle, or is a pickle/joblib file
                while ``format`` is ``"skops"``.
            taskpoint.CheckpointError: the store failed.
        """
        return self._decode(self._checkpoint.load_sync())

    async def load(self) -> PartialFitBundle | None:
        """Async :meth:`load_sync`."""
        return self._decode(await self._checkpoint.load())

    # -- resuming ---------------------------------------------------------------------

    def _resume(self, restored: PartialFitBundle | None, fresh: PartialFitBundle) -> PartialFitBundle:
        """``restored``, else the first attempt's ``fresh`` bundle, once it matches this run."""
        estimator, rng = fresh.estimator, fresh.rng
        if restored is None:
            restored = fresh
        if type(restored.estimator) is not type(estimator):
            raise BundleFormatError(
                f"the checkpoint holds a {type(restored.estimator).__name__} but this run "
                f"trains a {type(estimator).__name__}: point the checkpoint somewhere else",
                path=self._filename,
            )
        if (restored.rng is None) != (rng is None):
            raise BundleFormatError(
                "the checkpoint was saved "
                + ("without" if restored.rng is None else "with")
                + " an rng but this run passes "
                + ("one" if rng is not None else "none")
                + ": keep the rng argument the same across attempts",
                path=self._filename,
            )
        self._saves.begin(restored.progress)  # report it; defer SIGTERM to the next save
        return restored

    def resume_sync(
        self,
        estimator: Any,
        *,
        rng: np.random.Generator | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PartialFitBundle:
        """The restored bundle, or a fresh one at progress 0 built from the arguments.

        Args:
            estimator: the untrained estimator a first attempt starts from.
            rng: the generator a first attempt draws from (restored ones carry their own).
            metadata: a first attempt's metadata.

        Raises:
            TypeError: ``estimator`` has no ``partial_fit``.
            BundleFormatError: the checkpoint holds another kind of estimator, or disagrees
                on whether there is an rng.
            UntrustedTypesError: as in :meth:`load_sync`.
        """
        fresh = PartialFitBundle(estimator, 0, rng, dict(metadata or {}))  # before any I/O
        return self._resume(self.load_sync(), fresh)

    async def resume(
        self,
        estimator: Any,
        *,
        rng: np.random.Generator | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PartialFitBundle:
        """Async :meth:`resume_sync`."""
        fresh = PartialFitBundle(estimator, 0, rng, dict(metadata or {}))
        return self._resume(await self.load(), fresh)

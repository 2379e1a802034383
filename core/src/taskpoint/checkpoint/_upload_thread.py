"""``UploadThread``: background uploads one at a time, the newest waiting one winning.

Every background upload in core and the adapters runs on one of these: a checkpoint's
background saves (:class:`taskpoint.checkpoint._save.Saves`), a
:class:`~taskpoint.checkpoint.mirror.FolderMirror`'s uploads to another system's
checkpoint, ``taskpoint_pytorch``'s state saves. One job runs at a time on a daemon thread
and at most one waits behind it; a newer job replaces the waiting one (it is *coalesced*:
never run, its ``on_drop`` called, and counted), so what runs next is always the newest
asked for. A checkpoint whose ``when_busy`` is ``"wait"`` waits for the thread before it
starts a job instead, so nothing waits behind the running job to be replaced.

Waiting for the thread lets the newest go first: when a job waits behind the running one,
and the running one said how to stop it (``start(stop=...)``, or ``hand_over(stop=...)``
once it handed its save to a checkpoint), :meth:`UploadThread.idle` and
:meth:`UploadThread.wait` stop it before they wait. It holds older state than the job
behind it, whose upload would otherwise start only once its own had finished; stopped, it
ends uncommitted, and the job behind it runs at once. Not after a preemption signal: the
grace period may leave room for the upload nearly done and not for a whole new one. The
owners' stop functions do nothing where saves must all commit (``when_busy="wait"``).

Jobs run below the caller's priority (:func:`run_niced`, by
:func:`taskpoint.checkpoint._uploader.upload_nice`) unless a preemption signal had come when
they were started: training waits for a preemption save.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from taskpoint import preemption
from taskpoint.checkpoint._uploader import upload_nice

__all__ = ["UploadThread", "lower_priority", "run_niced"]

log = logging.getLogger(__name__)


def lower_priority(nice: int | None = None) -> bool:
    """Make the calling thread (and the threads it starts afterwards) yield the CPU to
    training: ``nice`` (by default :func:`upload_nice`) below this process's priority.

    Linux schedules threads individually, so this lowers the calling thread only. An
    unprivileged thread cannot raise its priority back: call it only in a thread that runs
    nothing training waits on.

    Returns:
        Whether the priority was lowered.
    """
    amount = upload_nice() if nice is None else nice
    if amount <= 0:
        return False
    with contextlib.suppress(AttributeError, OSError):
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(base + amount, 19))
        return True
    return False


def run_niced(job: Callable[[], Any], nice: int) -> Any:
    """Run ``job`` on a thread of its own, ``nice`` below this process's priority, and
    return what it returned (or raise what it raised); in this thread when ``nice`` is 0.
    The calling thread keeps its priority, for the next save that must not be niced."""
    if nice <= 0:
        return job()
    box: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        lower_priority(nice)
        try:
            box.append(job())
        except BaseException as exc:  # raised in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="taskpoint-background-save-niced", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return box[0]


@dataclass(frozen=True)
class _Job:
    """One job of an :class:`UploadThread`, as started."""

    job: Callable[[], object]
    context: contextvars.Context
    nice: int
    on_drop: Callable[[], object] | None
    ticket: int | None
    stop: Callable[[], object] | None


class UploadThread:
    """Jobs run one at a time in a daemon thread: one running, at most one pending behind
    it (see the module docstring). Each job runs with the context variables of the caller
    of :meth:`start` (another system's checkpoint, Flyte's, may find its task context
    through them) and, when ``nice`` and no preemption signal had come when it was started,
    :func:`upload_nice` below the caller's priority. A job's error is kept for the next
    :meth:`wait` or :meth:`raise_error` (or :meth:`take_error`).

    Starting a job while one is pending replaces the pending one (the newest wins): the
    replaced job never runs, its ``on_drop`` is called, :attr:`coalesced` counts it, and so
    does :attr:`replaced` for the job that runs next. The running job is stopped only by
    its own stop function, which a wait calls when a job is pending (see the module
    docstring).

    Args:
        name: the thread's name, also named in its log lines.
        nice: run jobs :func:`upload_nice` below the caller's priority (``False``: the
            jobs set their own priority).
    """

    def __init__(self, name: str, *, nice: bool = True) -> None:
        self._name = name
        self._nice = nice
        # Reentrant: a SIGTERM's handler may wait for the jobs while the main thread, which
        # it interrupted, holds the lock (taskpoint.preemption.wait_before_exit).
        self._cond = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._running = False
        self._handed = False  # the running job handed its save over (see hand_over)
        self._stop: Callable[[], object] | None = None  # stops the running job, once
        self._pending: _Job | None = None
        self._error: BaseException | None = None
        self._replaced = 0  # jobs coalesced since a job last started
        self._replaced_before = 0  # those counted for the job running now
        self.coalesced = 0
        """How many pending jobs newer ones replaced, in all."""

    def start(
        self,
        job: Callable[[], object],
        *,
        on_drop: Callable[[], object] | None = None,
        ticket: int | None = None,
        stop: Callable[[], object] | None = None,
    ) -> bool:
        """Run ``job`` once the job running (if any) has finished, replacing the job
        pending (if any); never waits.

        Args:
            job: the work.
            on_drop: called if ``job`` is replaced or dropped before it starts.
            ticket: its place among the owner's saves, for :meth:`supersede`.
            stop: once ``job`` runs, ends it early, uncommitted, without waiting (any
                thread may call it); a wait calls it when a newer job is pending.

        Returns:
            Whether a pending job was replaced.

        Raises:
            ValueError: ``TASKPOINT_GRACE_PERIOD`` or ``TASKPOINT_UPLOAD_NICE`` is set to
                something unusable.
        """
        preemption.hold_default_exit()  # a SIGTERM nobody handles lets the job commit before ending us
        nice = 0 if not self._nice or preemption.requested() else upload_nice()
        entry = _Job(job, contextvars.copy_context(), nice, on_drop, ticket, stop)
        with self._cond:
            replaced = self._take_pending()
            self._pending = entry
            if self._thread is None or not self._thread.is_alive():  # none, or not in a fork
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        self._dropped(replaced)
        return replaced is not None

    def supersede(self, ticket: int) -> bool:
        """Drop the pending job if its ticket is older than ``ticket`` (a newer save
        started in the caller's thread); whether one was dropped."""
        with self._cond:
            pending = self._pending
            stale = pending is not None and pending.ticket is not None and pending.ticket < ticket
            dropped = self._take_pending() if stale else None
        self._dropped(dropped)
        return dropped is not None

    def drop_pending(self) -> bool:
        """Drop the job pending behind the running one, if any (its ``on_drop`` is called):
        a save that goes first (a preemption save) replaces it. A job pending while none
        runs is about to start, and is kept. Returns whether one was dropped."""
        with self._cond:
            dropped = self._take_pending() if self._running else None
        self._dropped(dropped)
        return dropped is not None

    def note_coalesced(self, count: int = 1) -> None:
        """Count ``count`` jobs replaced elsewhere (an adapter's own upload thread) in
        :attr:`replaced` for the next job to run."""
        with self._cond:
            self._replaced += count

    def take_coalesced(self) -> int:
        """The jobs replaced since a job last started, once: a save committing outside the
        thread (a blocking one, starting now) reports them instead of the next job."""
        with self._cond:
            count, self._replaced = self._replaced, 0
            return count

    @property
    def replaced(self) -> int:
        """For the job running now (read from within it): how many jobs were replaced
        between the start of the job before it and its own (see :meth:`note_coalesced`,
        :meth:`take_coalesced`). A running job is never replaced, so the count is fixed."""
        with self._cond:
            return self._replaced_before

    def _take_pending(self) -> _Job | None:
        """Remove the pending job and count it as coalesced (with ``_cond`` held)."""
        dropped, self._pending = self._pending, None
        if dropped is not None:
            self.coalesced += 1
            self._replaced += 1
            self._cond.notify_all()
        return dropped

    def _dropped(self, job: _Job | None) -> None:
        """Tell a job that was replaced or dropped (without ``_cond`` held)."""
        if job is None:
            return
        log.info("%s: a job waiting behind the running one was replaced by a newer one "
                 "(coalesced)", self._name)
        if job.on_drop is not None:
            job.on_drop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                entry = self._pending
                if entry is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._pending = None
                self._running = True
                self._handed = False
                self._stop = entry.stop
                self._replaced_before, self._replaced = self._replaced, 0
            try:
                run_niced(functools.partial(entry.context.run, entry.job), entry.nice)
            except BaseException as exc:  # kept for the next wait()
                log.warning("%s failed: %s: %s", self._name, type(exc).__name__, exc)
                with self._cond:
                    self._error = exc
            finally:
                with self._cond:
                    self._running = False
                    self._handed = False
                    self._stop = None
                    self._replaced_before = 0
                    self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """Whether a job is running or pending."""
        with self._cond:
            return self._running or self._pending is not None

    def idle(self, timeout: float | None = None) -> bool:
        """Block until no job runs or is pending, for at most ``timeout`` seconds (``None``:
        no limit); whether none is. The newest goes first: a running job that can be
        stopped, with a job pending behind it, is stopped (see the module docstring). A
        job's error stays kept."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._newest_first(deadline)
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._running and self._pending is None, _left(deadline)
            )

    def _newest_first(self, deadline: float | None) -> None:
        """Stop the running job if a job is pending behind it and it can be stopped; wait
        (until ``deadline``) for a running job that is still handing its save over to
        say how. Nothing after a preemption signal."""
        if preemption.requested():
            return
        with self._cond:
            self._cond.wait_for(  # until nothing to stop, or the running job said how (or won't)
                lambda: self._pending is None or not self._running or self._handed
                or self._stop is not None,
                _left(deadline),
            )
            stop = self._stop if self._running and self._pending is not None else None
            if stop is not None:
                self._stop = None
        if stop is not None:
            log.info("%s: stopping the upload running for the newer one waiting behind it",
                     self._name)
            stop()

    def hand_over(self, stop: Callable[[], object] | None = None) -> None:
        """Say, from the running job, that what is left of it only waits for a save it
        has handed to a :class:`taskpoint.Checkpoint`, which orders its saves by when they
        were asked for (a newer blocking save there stops that one's upload): a save that
        goes first need not wait for the rest (:meth:`wait_handed`).

        Args:
            stop: stops that save, uncommitted, without waiting: a wait calls it when a
                newer job is pending (see the module docstring).
        """
        with self._cond:
            if self._running:
                self._handed = True
                if stop is not None:
                    self._stop = stop
                self._cond.notify_all()

    def wait_handed(self, timeout: float | None = None) -> bool:
        """Block until none is pending and no job runs, or the running one has called
        :meth:`hand_over`, for at most ``timeout`` seconds (``None``: no limit); whether
        so. A job's error stays kept."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._pending is None and (not self._running or self._handed), timeout
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job runs or is pending.

        Returns:
            ``True`` once no job runs; ``False`` when ``timeout`` ran out first.

        Raises:
            BaseException: what a job raised (raised once).
        """
        if not self.idle(timeout):
            return False
        self.raise_error()
        return True

    def take_error(self) -> BaseException | None:
        """What a finished job raised, once; ``None`` when none failed since."""
        with self._cond:
            error, self._error = self._error, None
            return error

    def raise_error(self) -> None:
        """Raise what a finished job raised (once), without waiting for the jobs in flight.

        Raises:
            BaseException: that error.
        """
        error = self.take_error()
        if error is not None:
            raise error


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0; ``None`` for none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())

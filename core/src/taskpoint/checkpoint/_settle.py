"""Waiting for this process's background uploads: on demand, and at interpreter exit.

Everything that uploads in the background registers here (:func:`track`): each
checkpoint's saves, each :class:`taskpoint.checkpoint.mirror.FolderMirror`, the adapters' upload
threads. :func:`settle_uploads` waits for them (the adapters' restore functions call it, so
a retry in the same process never loads the store while the failed attempt's last upload
still runs).

At interpreter exit, including an exit on an uncaught exception, the uploads in flight or
queued are waited for, up to :data:`EXIT_WAIT_S` seconds in all, and then the upload
process (:mod:`taskpoint.checkpoint._uploader`) is told to finish and exit. This runs from
``threading._register_atexit``, which CPython's ``threading._shutdown`` calls (newest
first) before it joins the remaining threads, and so before ``concurrent.futures`` shuts
its thread pools down (it registers there too, when first imported; that import is made
here first, so this hook runs before its). From a plain ``atexit`` hook, which runs only
after ``threading._shutdown``, an upload still needing a pool failed with "cannot schedule
new futures after interpreter shutdown" and nothing committed. Where
``threading._register_atexit`` is missing (it is a CPython internal), a plain ``atexit``
hook does what it can. What must reach the store once the uploads settled (the attempt's
end record) registers with :func:`at_exit` and runs there too, for the same reason: the S3
client resolves a new connection's address on the event loop's thread pool.

A SIGTERM nobody handles waits the same way before it ends the process: a background
upload starting calls :func:`taskpoint.preemption.hold_default_exit`, which installs
taskpoint's handler where the signal had none, and that handler runs the wait registered
here (:func:`taskpoint.preemption.wait_before_exit`), so the uploads in flight commit, until
the grace period's end, before it ends the process as the default action would.

After a preemption signal the wait ends by the grace period's end too (the kill follows
it). An upload still running when the time is up is not waited for, and a warning says it
had not committed: an upload in the upload process finishes and commits there all the
same (the process outlives its parent to do so); one in a thread of this process ends
with it, uncommitted. Either way the store keeps the checkpoint before it.
"""

from __future__ import annotations

import atexit
import concurrent.futures.process
import concurrent.futures.thread
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from taskpoint import preemption
from taskpoint.checkpoint import _uploader

__all__ = ["EXIT_WAIT_S", "at_exit", "settle_uploads", "track", "untrack"]

log = logging.getLogger(__name__)

_POOLS = (concurrent.futures.thread, concurrent.futures.process)
"""Imported before :func:`_register` runs, so their exit hooks run after ours."""
EXIT_WAIT_S = 60.0
"""How long interpreter exit waits, in all, for the uploads in flight (seconds)."""


class _Waitable(Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...


_tracked: weakref.WeakSet[_Waitable] = weakref.WeakSet()
_exit_hooks: list[Callable[[], object]] = []


def track(uploads: _Waitable) -> None:
    """Make :func:`settle_uploads` (and interpreter exit) wait for ``uploads``.

    Held weakly: an object collected is forgotten. ``uploads.wait(timeout)`` must return
    whether nothing runs any more; what it raises is logged.
    """
    _tracked.add(uploads)


def untrack(uploads: _Waitable) -> None:
    """Forget ``uploads`` (it has nothing left to upload, and never will)."""
    _tracked.discard(uploads)


def settle_uploads(timeout: float | None = None) -> None:
    """Wait for every tracked upload still running in this process.

    Their errors are logged, not raised: they belong to attempts that have ended (the store
    keeps the checkpoint before each failed upload).

    Args:
        timeout: at most this many seconds per upload (``None``: no limit).
    """
    for uploads in list(_tracked):
        _settle(uploads, timeout)


def _settle(uploads: _Waitable, timeout: float | None) -> None:
    try:
        if not uploads.wait(timeout):
            log.warning(
                "a background save had not committed after %.1f s; not waiting for it any "
                "longer (until it commits, the newest checkpoint is the one before it)",
                timeout,
            )
    except Exception as exc:
        log.warning("an upload of an earlier attempt failed: %s: %s", type(exc).__name__, exc)


def _exit_deadline(notice: preemption.Notice | None) -> float:
    """When an ending process stops waiting for uploads (``time.monotonic()``):
    :data:`EXIT_WAIT_S` from now, or the grace period's end when ``notice`` sets a sooner one."""
    deadline = time.monotonic() + EXIT_WAIT_S
    return deadline if notice is None else min(deadline, notice.deadline)


def _settle_until(deadline: float) -> None:
    """Wait for every tracked upload until ``deadline`` (``time.monotonic()``)."""
    for uploads in list(_tracked):
        _settle(uploads, max(0.0, deadline - time.monotonic()))


def _settle_before_signal_exit(notice: preemption.Notice) -> None:
    """The preemption signal is about to end the process: wait for every tracked upload
    until the grace period's end (at most :data:`EXIT_WAIT_S` seconds in all). The upload
    process is left running: it finishes its uploads on its own."""
    _settle_until(_exit_deadline(notice))


def at_exit(hook: Callable[[], object]) -> None:
    """Run ``hook`` at interpreter exit, once the uploads settled, while the thread
    pools that store calls need still take work (see the module's documentation). Hooks
    run in the order registered; what one raises is logged."""
    _exit_hooks.append(hook)


def _settle_at_exit() -> None:
    """Wait for every tracked upload, then end the upload process, within
    :data:`EXIT_WAIT_S` seconds in all, and by the grace period's end after a preemption
    signal; then run the :func:`at_exit` hooks."""
    deadline = _exit_deadline(preemption.notice())
    _settle_until(deadline)
    if not _uploader.close_shared(max(0.0, deadline - time.monotonic())):
        log.warning("the upload process still runs; it finishes its uploads on its own")
    for hook in _exit_hooks:
        try:
            hook()
        except Exception:
            log.exception("an exit hook failed: %r", hook)


def _register() -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_settle_at_exit)
            return
        except RuntimeError:  # imported while the interpreter shuts down
            pass
    atexit.register(_settle_at_exit)


_register()
preemption.wait_before_exit(_settle_before_signal_exit)
# A fork's child has none of its parent's upload threads: nothing of theirs to wait for.
os.register_at_fork(after_in_child=_tracked.clear)
# Nor its exit hooks, which are about this process's end.
os.register_at_fork(after_in_child=_exit_hooks.clear)

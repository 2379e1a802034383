"""Abandoning a store call that has stopped moving bytes.

A network that goes silent (a cut link, a black-holed route) makes no error: an HTTP client
waits for an answer, for a "100 Continue" or for a socket buffer to drain, with no timeout
of its own, until the kernel gives up on the connection many minutes later. So every try
of a store call on a network backend runs under a watchdog that measures *progress*, not
total time: a try is abandoned once no bytes have moved for the stall timeout. A healthy
transfer, however large and however slow its link, keeps ticking and is never cut; a call
that moves nothing (a listing, a small PUT) is in effect limited to the stall timeout.

- :class:`Progress`: when bytes last moved for one call (ticked by the transfer code);
- :class:`Stalled`: the transient error an abandoned try raises (a ``TimeoutError``);
- :func:`run`: a coroutine on the backend's event loop, awaited from a blocking caller
  under the watchdog; the coroutine is cancelled when it stalls, with everything it
  awaits (the parts of a multipart upload among them);
- :func:`bounded`: the same inside the event loop, for one part of a transfer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Progress", "Stalled", "bounded", "run"]

T = TypeVar("T")

_POLL_S = 0.5
"""The longest the blocking caller waits between two looks at the progress."""


class Stalled(TimeoutError):
    """A try of a store call moved no bytes for its stall timeout and was abandoned.

    A ``TimeoutError``, so :func:`taskpoint.store._faults.is_transient` retries it.
    """


class Progress:
    """When bytes last moved for one store call (or one part of it), in monotonic time.

    Args:
        stall: the seconds without progress after which the call is abandoned.
        parent: a call's progress, ticked with each tick of this part's.
    """

    def __init__(self, stall: float, parent: Progress | None = None) -> None:
        self.stall = stall
        self._parent = parent
        self._last = time.monotonic()

    def tick(self) -> None:
        """Note that bytes moved now (safe from any thread)."""
        self._last = time.monotonic()
        if self._parent is not None:
            self._parent.tick()

    def child(self) -> Progress:
        """A part's progress, with the same stall timeout, ticking this one too."""
        return Progress(self.stall, self)

    def idle(self) -> float:
        """Seconds since bytes last moved (or since this object was made)."""
        return time.monotonic() - self._last

    def stalled(self) -> Stalled:
        """The error that abandons the call."""
        return Stalled(f"no bytes moved for {self.stall:g} s: the network or the store is silent")


def run(
    loop: asyncio.AbstractEventLoop,
    start: Callable[[Progress], Coroutine[Any, Any, T]],
    stall: float,
) -> T:
    """Run ``start(progress)`` on ``loop`` (another thread's) and wait for its result.

    Args:
        loop: the running event loop of the backend (fsspec's I/O thread).
        start: makes the coroutine, handed the :class:`Progress` it may tick; one that
            never ticks is limited to ``stall`` seconds in all.
        stall: seconds without progress after which the coroutine is cancelled.

    Raises:
        Stalled: no progress for ``stall`` seconds; the coroutine was cancelled.
        Exception: whatever the coroutine raised.
    """
    progress = Progress(stall)
    future = asyncio.run_coroutine_threadsafe(start(progress), loop)
    try:
        while True:
            left = stall - progress.idle()
            if left <= 0:
                raise progress.stalled()
            done, _ = concurrent.futures.wait([future], timeout=min(left, _POLL_S))
            if done:
                return future.result()
    finally:
        # Also on KeyboardInterrupt: nothing of an abandoned call keeps running.
        future.cancel()


async def bounded(awaitable: Awaitable[T], progress: Progress) -> T:
    """Await ``awaitable`` (inside the event loop) until it finishes or ``progress`` shows
    no bytes moved for its stall timeout.

    Raises:
        Stalled: no progress for the stall timeout; ``awaitable`` was cancelled.
        Exception: whatever ``awaitable`` raised.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            left = progress.stall - progress.idle()
            if left <= 0:
                raise progress.stalled()
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()

"""Preemption notices: SIGTERM noted with its deadline, composed with other handlers.

Spot reclaims, pod evictions, SLURM preemption and managed-spot stops send SIGTERM, then
kill the process once a grace period has passed. taskpoint's handler notes the signal as
a :class:`Notice` (when it came, the deadline the grace period sets), then runs the
handler that was installed before it, so a framework's own handler still runs::

    from taskpoint import preemption

    with preemption.deferred():          # an adapter that stops at a step boundary
        for step in range(start, steps):
            train_one_step()
            if preemption.requested():   # agreed across ranks by the adapter
                save_now()
                break

Inside :func:`deferred`, a SIGTERM only sets the notice: the code polls
:func:`requested` at its next step boundary, saves and stops there. Outside it, the
fallback installed with the handler runs at once (inside a task: the attempt's
``on_preempt`` callbacks, then :class:`taskpoint.Preempted`).

The grace period comes from ``TASKPOINT_GRACE_PERIOD`` (seconds, default 30: Kubernetes'
``terminationGracePeriodSeconds`` default). Set it to what the platform gives: AWS spot
instances get 120 s of notice; SLURM sends the signal ``--signal=TERM@<seconds>`` before
the time limit.

A SIGTERM that nobody handles (its default action) ends the process, but not while a
background upload runs: the first background save of a process, made from the main thread,
installs taskpoint's handler where the signal has no other, and that handler waits (up to
the grace period's end) for the uploads in flight (:func:`wait_before_exit`) before it
ends the process as the default action would. A launcher tearing a job down (``torchrun``
terminating the surviving ranks after one failed) so never abandons a save in flight.

Handlers compose: whoever installs last runs the other. A library that installs its own
SIGTERM handler without calling the one before it (transformers' JIT checkpointing does)
would hide the signal from taskpoint, so :func:`install` called again puts taskpoint's
handler back on top, calling that library's handler in turn.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from taskpoint._env import seconds_from_env

__all__ = [
    "DEFAULT_GRACE_S",
    "ENV_GRACE",
    "ENV_SAVE",
    "Notice",
    "deferred",
    "grace_period",
    "hold_default_exit",
    "install",
    "notice",
    "pinned",
    "relay",
    "requested",
    "reset",
    "save_on_preemption",
    "wait_before_exit",
]

log = logging.getLogger(__name__)

ENV_GRACE = "TASKPOINT_GRACE_PERIOD"
"""Seconds between the preemption signal and the kill that follows it."""
DEFAULT_GRACE_S = 30.0
"""The grace period without ``TASKPOINT_GRACE_PERIOD``: Kubernetes' default."""
ENV_SAVE = "TASKPOINT_SAVE_ON_PREEMPTION"
"""``1`` (or ``true``/``yes``/``on``) makes the adapters save on SIGTERM anywhere; ``0``
(``false``/``no``/``off``) turns it off everywhere. Unset: inside a taskpoint task and in a
process of the environment contract."""
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def save_on_preemption(choice: bool | None, *, in_task: bool) -> bool:
    """Whether an adapter turns SIGTERM into a save: ``choice`` when given (the adapter's
    own ``save_on_preemption`` argument), else ``TASKPOINT_SAVE_ON_PREEMPTION`` when set,
    else ``in_task``: whether something restarts the code after the signal (callers pass
    :func:`taskpoint.runtime.context.supervised`: inside a taskpoint task, whose runner
    retries a preempted attempt, or in a process of the environment contract, which its
    orchestrator restarts).

    Raises:
        ValueError: the variable is set to something other than a yes or a no.
    """
    if choice is not None:
        return bool(choice)
    value = os.environ.get(ENV_SAVE, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value:
        raise ValueError(
            f"{ENV_SAVE} must be 1/true/yes/on or 0/false/no/off; got {os.environ[ENV_SAVE]!r}"
        )
    return in_task


@dataclass(frozen=True)
class Notice:
    """A preemption signal this process received.

    Attributes:
        signal: the signal's name (``"SIGTERM"``).
        received: Unix time (seconds) it arrived.
        deadline: ``time.monotonic()`` by which the process expects to be killed.
    """

    signal: str
    received: float
    deadline: float

    def remaining(self) -> float:
        """Seconds left before the deadline (0 once it has passed)."""
        return max(0.0, self.deadline - time.monotonic())


def grace_period(env: Mapping[str, str] | None = None) -> float:
    """The grace period in seconds, from ``TASKPOINT_GRACE_PERIOD`` in ``env`` (default
    ``os.environ``) or :data:`DEFAULT_GRACE_S`.

    Raises:
        ValueError: the variable is set but is not a finite number of seconds above 0.
    """
    return seconds_from_env(
        os.environ if env is None else env, ENV_GRACE, DEFAULT_GRACE_S,
        "a number of seconds above 0 (the time between the preemption signal and the kill)",
    )


_lock = threading.Lock()
_notice: Notice | None = None
_previous: Any = signal.SIG_DFL
_grace = DEFAULT_GRACE_S
_fallback: Callable[[Notice], None] | None = None
_deferred = 0
_handling = False
_exit_waits: list[Callable[[Notice], object]] = []
_pinned: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "taskpoint_preemption_pinned", default=None
)


def notice() -> Notice | None:
    """The preemption signal received since the last :func:`reset`, or ``None``."""
    return _notice


def requested() -> bool:
    """Whether a preemption signal arrived since the last :func:`reset` (inside
    :func:`pinned`, the answer pinned there)."""
    answer = _pinned.get()
    return _notice is not None if answer is None else answer


@contextlib.contextmanager
def pinned(answer: bool) -> Iterator[None]:
    """Within, in this context only (this thread, or this task), :func:`requested` is
    ``answer``: for a save made before (or after) the signal and handed to a checkpoint
    later from another thread, so its manifest says whether it was a preemption save as
    of when it was made (take ``answer`` with :func:`requested` then)."""
    token = _pinned.set(bool(answer))
    try:
        yield
    finally:
        _pinned.reset(token)


def relay(remaining: float | None = None, signal_name: str = "SIGTERM") -> Notice:
    """Note a preemption signal another rank of the job received, once the ranks agreed to
    stop together (:class:`taskpoint.distributed.torch_coordination.AnyRank`), due in ``remaining``
    seconds (``None``: the grace period from now); a notice this process already holds is
    kept. No handler runs. From then on this process's saves count as preemption saves and its attempt as
    one that received the signal (see :func:`notice`), as if the signal had reached it:
    the rank that saves is often not the rank that was signalled.

    Returns:
        The notice in force.

    Raises:
        ValueError: ``remaining`` is negative or not a number.
    """
    global _notice
    if remaining is None:
        remaining = _grace
    if not remaining >= 0:
        raise ValueError(f"remaining must be a number of seconds >= 0; got {remaining!r}")
    with _lock:
        if _notice is None:
            _notice = Notice(signal_name, time.time(), time.monotonic() + remaining)
        return _notice


def reset() -> None:
    """Forget the notice (an attempt starting afresh in the same process)."""
    global _notice
    _notice = None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While inside, a preemption signal only sets the notice; the code inside polls
    :func:`requested` at its step boundaries and stops there. Nests."""
    global _deferred
    with _lock:
        _deferred += 1
    try:
        yield
    finally:
        with _lock:
            _deferred -= 1


def install(fallback: Callable[[Notice], None] | None = None) -> bool:
    """Put taskpoint's SIGTERM handler on top, calling whichever handler it replaces.

    Idempotent, and safe to call again after another library replaced the handler: the
    replacement then runs after taskpoint's. Only the main thread can install handlers.

    Args:
        fallback: what a signal outside :func:`deferred` does after the notice is set and
            the replaced handler ran (inside a task: run ``on_preempt`` callbacks and raise
            :class:`taskpoint.Preempted`). ``None`` keeps the one installed before.

    Returns:
        Whether the handler is in place (``False`` outside the main thread).

    Raises:
        ValueError: ``TASKPOINT_GRACE_PERIOD`` is set to something other than seconds.
    """
    global _previous, _fallback, _grace
    grace = grace_period()
    with _lock:
        _grace = grace
        if fallback is not None:
            _fallback = fallback
        if threading.current_thread() is not threading.main_thread():
            return signal.getsignal(signal.SIGTERM) is _handle
        current = signal.getsignal(signal.SIGTERM)
        if current is not _handle:
            _previous = current
            signal.signal(signal.SIGTERM, _handle)
        return True


def hold_default_exit() -> bool:
    """Where SIGTERM has its default action (no handler at all), install taskpoint's, so
    that the signal still ends the process, but only after :func:`wait_before_exit`'s
    waits (uploads in flight committing). Handlers someone installed, and an ignored
    signal, are left as they are. Only the main thread can install handlers; elsewhere
    nothing changes.

    Returns:
        Whether taskpoint's handler is in place.

    Raises:
        ValueError: ``TASKPOINT_GRACE_PERIOD`` is set to something other than seconds.
    """
    current = signal.getsignal(signal.SIGTERM)
    if current is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        return install()
    return current is _handle


def wait_before_exit(wait: Callable[[Notice], object]) -> None:
    """Call ``wait(notice)`` before a preemption signal that no other handler takes ends
    the process (the signal's default action, which taskpoint's handler performs): for
    work that must finish first, bounded by ``notice.deadline``. What it raises is logged
    and the process ends all the same. Registered once per process, in order."""
    with _lock:
        if wait not in _exit_waits:
            _exit_waits.append(wait)


def _handle(signum: int, frame: FrameType | None) -> None:
    global _notice, _handling
    if _handling:  # a handler we called called us back: it composes too
        return
    if _notice is None:
        _notice = Notice(signal.Signals(signum).name, time.time(), time.monotonic() + _grace)
    _handling = True
    try:
        if callable(_previous):
            _previous(signum, frame)
    finally:
        _handling = False
    if _deferred:
        return  # the code inside deferred() saves and stops at its next step boundary
    if _fallback is not None:
        _fallback(_notice)
    elif _previous in (signal.SIG_DFL, None):
        # Nobody handles the signal but us: end the process as the default action would,
        # so installing taskpoint's handler never makes a process immune to SIGTERM; once
        # the uploads in flight have had until the deadline to commit.
        for wait in list(_exit_waits):
            try:
                wait(_notice)
            except Exception as exc:
                log.warning("before ending on %s: %s: %s", _notice.signal, type(exc).__name__, exc)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

"""One process's life under the environment contract: claimed as an attempt, its end recorded.

Outside a taskpoint task no runner numbers the attempts or records how they ended; the
process itself is the attempt (a Kubernetes Job's pod, a SLURM requeue, a spot fleet's new
machine). :func:`begin` makes it one: it claims the next attempt number from the action's
store as the process first asks :func:`taskpoint.ctx` (or takes the orchestrator's number
and records it), records earlier lives that died without an end record, and records this
life's end wherever the process can:

- an exception that ends the process (``sys.excepthook``): ``failed``, or ``preempted`` for
  :class:`taskpoint.Preempted`, with its traceback, after the context's
  :meth:`~taskpoint.TaskContext.on_failure` callbacks ran (:attr:`Life.on_failure`);
- a preemption signal: ``preempted`` at once when the step boundary sees it (before the
  save: a kill at the grace period's end can no longer land between the warning and the
  record), again when the training stops, and before a SIGTERM that nothing else handles
  ends the process (:func:`taskpoint.preemption.wait_before_exit`);
- a normal exit: ``succeeded``, or ``preempted`` after a preemption signal, once the
  background uploads settled (:func:`taskpoint.checkpoint._settle.at_exit`, which runs while
  the S3 client's thread pool still resolves addresses; a plain ``atexit`` hook is too
  late for an object store), or by a plain ``atexit`` hook where threading's exit hooks
  never ran (``os._exit`` after ``atexit._run_exitfuncs()``). ``sys.exit(status)`` is an
  exit like any other: its status is not visible there.

A process killed outright (SIGKILL, out of memory, its node lost) records nothing; the next
life records it as died when it claims its number
(:func:`taskpoint.format.history.note_unended`). Only the job's leading process (``RANK``
unset or ``0``) keeps the records; the other ranks' processes are not attempts of their own.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType

from taskpoint import preemption, progress
from taskpoint.checkpoint import _settle
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.errors import CheckpointError
from taskpoint.format import history
from taskpoint.format.history import Outcome
from taskpoint.store.store import Store

__all__ = [
    "FOLLOW_S", "PROCESS_STARTED", "RANKS_APART_S", "Life", "begin", "current", "follow_claim", "format_error",
    "leads",
]

log = logging.getLogger(__name__)


def format_error(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it (with its notes and causes), for the
    attempt's end record."""
    return "".join(traceback.format_exception(exc)).rstrip("\n")


_STARTED = history.process_started()
PROCESS_STARTED = time.time() if _STARTED is None else _STARTED
"""When this process started, Unix time (where ``/proc`` does not say: when this module loaded)."""
RANKS_APART_S = 5.0
"""How far apart the ranks of one job may start and still share an attempt."""
FOLLOW_S = 30.0
"""How long a job's other rank waits for its leading rank's claim of the attempt."""


def follow_claim(checkpoint_store: Store, previous: int | None) -> int:
    """The attempt number a job's other rank takes: the one its leading rank claimed for
    this process's life (the newest claim, made since this process started less
    :data:`RANKS_APART_S` and not ended before it started), waited for up to :data:`FOLLOW_S`; failing that, the
    number after ``previous`` (0 first)."""
    after = 0 if previous is None else previous + 1
    deadline = time.monotonic() + FOLLOW_S
    while True:
        found = history.newest_claim_since(
            checkpoint_store, PROCESS_STARTED - RANKS_APART_S, PROCESS_STARTED
        )
        if found is not None and found >= after:
            return found
        if time.monotonic() >= deadline:
            log.warning("%s: no claim of the attempt by the job's leading rank after %.0f s; "
                        "numbering this one %d", checkpoint_store.url, FOLLOW_S, after)
            return after
        time.sleep(0.2)


def leads(env: dict[str, str] | None = None) -> bool:
    """Whether this process leads its job (``RANK`` unset, blank or ``0``)."""
    rank = (os.environ if env is None else env).get("RANK", "").strip()
    return rank in ("", "0")


class Life:
    """This process as one attempt of an action, recorded in ``checkpoint``'s history.

    Args:
        checkpoint: the action's checkpoint, its attempt claimed.
        preempted: the exception type that ends a preempted attempt.
    """

    def __init__(self, checkpoint: Checkpoint, preempted: type[BaseException]) -> None:
        self.checkpoint = checkpoint
        self._preempted = preempted
        self._final = False
        self._lock = threading.Lock()
        self.pid = os.getpid()
        """The process whose life this is: a forked child inherits the object, not the life."""
        self.on_failure: Callable[[BaseException], object] | None = None
        """Called with the exception that ends the process, before its end is recorded."""

    def __repr__(self) -> str:
        return f"Life({self.checkpoint!r}, ended={self._final})"

    def preempted(self, message: str, *, step: int | None = None, final: bool = False) -> None:
        """Record the life as ``preempted`` (``"Preempted: <message>"``) at ``step``;
        ``final`` makes it the last record this life writes."""
        self._record("preempted", f"Preempted: {message}", step=step, final=final)

    def exited(self) -> None:
        """The process exits normally: ``succeeded``, or ``preempted`` after a signal."""
        notice = preemption.notice()
        if notice is None:
            self._record("succeeded", None, final=True)
        else:
            self.preempted(f"received {notice.signal}; the process exited", final=True)

    def raised(self, exc: BaseException) -> None:
        """An exception ends the process: ``preempted`` for a preemption, else ``failed``."""
        outcome: Outcome = "preempted" if isinstance(exc, self._preempted) else "failed"
        self._record(
            outcome, f"{type(exc).__name__}: {exc}"[:2000], traceback=format_error(exc),
            final=True,
        )

    def _record(
        self,
        outcome: Outcome,
        error: str | None,
        *,
        step: int | None = None,
        traceback: str | None = None,
        final: bool,
    ) -> None:
        with self._lock:
            if self._final:
                return
            self._final = final
        try:
            self.checkpoint.mark_ended(
                outcome, error, step=progress.current_step() if step is None else step,
                traceback=traceback,
            )
        except (CheckpointError, ValueError) as exc:
            log.warning("could not record the end of this process's attempt: %s", exc)


_life: Life | None = None
_hooked = False


def current() -> Life | None:
    """This process's life, once :func:`begin` made one; ``None`` in a forked child, which
    inherits the object but whose end is not the life's (a data loader's worker runs
    threading's exit hooks as it ends, a plain fork's child the ``atexit`` ones too)."""
    return _life if _life is not None and _life.pid == os.getpid() else None


def begin(checkpoint: Checkpoint, preempted: type[BaseException]) -> Life | None:
    """Make this process an attempt of ``checkpoint``'s action (see the module docs):
    claim its number (or record the one ``checkpoint`` was given), and put the hooks
    that record its end in place. Replaces an earlier life of this process, whose end is
    then not recorded (only an environment changed under a running process does that).

    Returns:
        The life, or ``None`` where the store could not be reached to claim a number
        (said at WARNING; the first save claims it then, as before).
    """
    global _life
    try:
        checkpoint.mark_started()
    except CheckpointError as exc:
        log.warning("%s: could not claim an attempt number for this process: %s",
                    checkpoint.url, exc)
        return None
    _life = Life(checkpoint, preempted)
    _hook()
    return _life


def _hook() -> None:
    global _hooked
    if _hooked:
        return
    _hooked = True
    _settle.at_exit(_at_exit)  # after the uploads, while the thread pools take work
    atexit.register(_at_exit)  # where those hooks never ran (os._exit after atexit's)
    previous = sys.excepthook

    def excepthook(
        kind: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        life = current()
        if life is not None:
            if life.on_failure is not None:
                life.on_failure(exc)
            life.raised(exc)
        previous(kind, exc, tb)

    sys.excepthook = excepthook
    preemption.wait_before_exit(_before_signal_exit)  # when the signal's default ends it
    try:
        preemption.hold_default_exit()
    except ValueError as exc:  # a bad TASKPOINT_GRACE_PERIOD: the first save says so again
        log.warning("%s", exc)


def _at_exit() -> None:
    life = current()
    if life is not None:
        life.exited()


def _before_signal_exit(notice: preemption.Notice) -> None:
    life = current()
    if life is not None:
        life.preempted(f"received {notice.signal}; nothing handled it", final=True)

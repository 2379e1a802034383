"""``ctx()``: what the running task knows about itself.

Inside a ``@env.task`` the context comes from the runtime. Outside any task, in a plain
script that another orchestrator restarts, it comes from the environment:

============================  =============================================================
``TASKPOINT_ROOT``            the checkpoint root URL (default ``.taskpoint/checkpoints``)
``TASKPOINT_ACTION``          the task's name (default: the script's file name)
``TASKPOINT_RUN_ID``          the run (job) id that all restarts share
``TASKPOINT_ATTEMPT``         this attempt's number; without it the store numbers attempts
============================  =============================================================

Without ``TASKPOINT_ACTION``, these orchestrators are recognised by their stable job
identity: torchelastic / ``torchrun`` (``TORCHELASTIC_RUN_ID``, attempt from
``TORCHELASTIC_RESTART_COUNT``), SLURM (``SLURM_JOB_ID``, attempt from
``SLURM_RESTART_COUNT``) and SkyPilot (``SKYPILOT_TASK_ID``). Anywhere else ``ctx()``
outside a task is ``None``.

Under the environment contract each process is one attempt (one life of the run): the
first ``ctx()`` of the job's leading process (``RANK`` unset or ``0``) claims its number
from the store, unless the orchestrator gave one, and records its end when it exits
(:mod:`taskpoint.runtime._life`); ``ctx().attempt`` then counts the run's lives. Such a
process saves on SIGTERM by default (:func:`supervised`): its orchestrator restarts it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from taskpoint import preemption
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.runtime import _life
from taskpoint.runtime.names import check_name
from taskpoint.store.store import check_location

__all__ = [
    "ENV_ACTION",
    "ENV_ATTEMPT",
    "ENV_ROOT",
    "ENV_RUN_ID",
    "Preempted",
    "TaskContext",
    "ctx",
    "environment_context",
    "in_task",
    "root_from",
    "saves_on_preemption",
    "supervised",
]

log = logging.getLogger(__name__)

ENV_ROOT = "TASKPOINT_ROOT"
ENV_ACTION = "TASKPOINT_ACTION"
ENV_RUN_ID = "TASKPOINT_RUN_ID"
ENV_ATTEMPT = "TASKPOINT_ATTEMPT"
DEFAULT_ROOT = Path(".taskpoint") / "checkpoints"
"""The embedded local store, relative to the working directory."""
DEFAULT_RUN_ID = "default"
"""The run id of a plain script that names none and runs under no known orchestrator."""


class Preempted(Exception):
    """The attempt received SIGTERM; its ``on_preempt`` callbacks have run.

    It derives from ``Exception`` so the runtime retries the attempt like any failure.
    """


@dataclass(frozen=True)
class TaskContext:
    """The context of one attempt of a running task.

    Attributes:
        task: the task's name (``"<environment>.<function>"`` inside ``@env.task``).
        run_id: the run this action belongs to.
        action: the action's id, ``"<task>/<run_id>"``: all attempts share it.
        attempt: this attempt's number, from 0; ``None`` until the store numbers it.
        retries: how many retries the task allows after attempt 0 (0 when unknown).
        checkpoint: the action's checkpoint, or ``None`` where checkpoints are disabled.
    """

    task: str
    run_id: str
    action: str
    attempt: int | None
    retries: int
    checkpoint: Checkpoint | None
    _preempt_callbacks: list[Callable[[], object]] = field(
        default_factory=list, repr=False, compare=False
    )
    _end_callbacks: list[Callable[[], object]] = field(
        default_factory=list, repr=False, compare=False
    )
    _failure_callbacks: list[Callable[[BaseException], object]] = field(
        default_factory=list, repr=False, compare=False
    )

    def on_preempt(self, callback: Callable[[], object]) -> Callable[[], object]:
        """Run ``callback`` when this attempt receives SIGTERM, before it ends.

        Callbacks run in the order registered, in the main thread; a typical one saves a
        checkpoint. Then the attempt fails with :class:`Preempted` and is retried. A
        callback already registered (an equal bound method: an adapter's hook called at
        each training start) is not added again. Usable as a decorator; returns
        ``callback``.
        """
        if callback not in self._preempt_callbacks:
            self._preempt_callbacks.append(callback)
        install_sigterm_handler()
        return callback

    def _run_preempt_callbacks(self) -> None:
        for callback in list(self._preempt_callbacks):
            callback()

    def on_end(self, callback: Callable[[], object]) -> Callable[[], object]:
        """Run ``callback`` once this attempt's function has returned or raised, before the
        attempt's outcome is recorded and before a retry starts.

        For adapters of plain training loops, which see no "training ended" call: they
        wait there for an upload still in flight and undo what they set up for the
        attempt. Callbacks run once each, newest first; they all run even when one raises,
        and the first error then fails a successful attempt (a failed one logs it). Usable
        as a decorator; returns ``callback``.
        """
        self._end_callbacks.append(callback)
        return callback

    def on_failure(
        self, callback: Callable[[BaseException], object]
    ) -> Callable[[BaseException], object]:
        """Run ``callback(exc)`` when an exception ``exc`` ends this attempt: its function
        raised (inside a task), or nothing caught it and it ends the process (the
        environment contract's leading process). Not for :class:`Preempted` (its
        ``on_preempt`` callbacks ran) nor for what is not an ``Exception``
        (``KeyboardInterrupt``, ``SystemExit``).

        For adapters that save the state at the failure, so that the retry need not
        recompute the steps since the last save. Callbacks run once each, in the order
        registered, before the :meth:`on_end` callbacks and before the attempt's uploads
        settle; what one raises is logged. A callback already registered (an equal bound
        method) is not added again. Usable as a decorator; returns ``callback``.
        """
        if callback not in self._failure_callbacks:
            self._failure_callbacks.append(callback)
        return callback

    def _run_failure_callbacks(self, exc: BaseException) -> None:
        """Run and forget the :meth:`on_failure` callbacks for ``exc`` (see there)."""
        callbacks, self._failure_callbacks[:] = list(self._failure_callbacks), []
        if not isinstance(exc, Exception) or isinstance(exc, Preempted):
            return
        for callback in callbacks:
            try:
                callback(exc)
            except Exception:
                log.exception("%s: an on_failure callback failed: %r", self.action, callback)

    def _run_end_callbacks(self) -> None:
        """Run and forget the :meth:`on_end` callbacks; raise the first error after all ran."""
        error: Exception | None = None
        while self._end_callbacks:
            try:
                self._end_callbacks.pop()()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error


_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar(
    "taskpoint_context", default=None
)
_env_context: TaskContext | None = None
_env_key: tuple[str | None, ...] | None = None
_ENV_NAMES = (
    ENV_ROOT, ENV_ACTION, ENV_RUN_ID, ENV_ATTEMPT,
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "SKYPILOT_TASK_ID",
)


def root_from(env: Mapping[str, str]) -> str:
    """``TASKPOINT_ROOT`` from ``env``, else the embedded local store's absolute path.

    Raises:
        ValueError: the variable is set but blank.
    """
    value = env.get(ENV_ROOT)
    if value is None:
        return str(DEFAULT_ROOT.absolute())
    return check_location(ENV_ROOT, value)


def in_task() -> bool:
    """Whether this code runs inside a taskpoint task (``@env.task``), whose runner retries
    the attempt, rather than under the environment contract or nothing."""
    return _current.get() is not None


def supervised() -> bool:
    """Whether something restarts this code after a preemption: a taskpoint task's runner
    (inside ``@env.task``), or the orchestrator the environment contract names (a process
    with ``TASKPOINT_ACTION``, under torchrun, SLURM or SkyPilot). Where it does, code
    that can save on SIGTERM does by default (see
    :func:`taskpoint.preemption.save_on_preemption`).

    Raises:
        ValueError: an environment contract variable holds an unusable value.
    """
    return ctx() is not None


def saves_on_preemption(choice: bool | None, *, restarted: bool = False) -> bool:
    """Whether an adapter turns SIGTERM into a save: :func:`taskpoint.preemption.save_on_preemption`'s
    rule, for code that something restarts after a preemption when :func:`supervised`
    says so or ``restarted`` is true (an adapter that knows of another restarter, such as
    a framework's own just-in-time checkpointing).

    Args:
        choice: the adapter's ``save_on_preemption`` argument; ``None`` leaves the answer
            to ``TASKPOINT_SAVE_ON_PREEMPTION``, then to whether the code is restarted.
        restarted: whether something the adapter knows of restarts the code, besides a
            taskpoint task's runner and the environment contract's orchestrator.

    Raises:
        ValueError: ``TASKPOINT_SAVE_ON_PREEMPTION`` or an environment contract variable
            holds an unusable value.
    """
    return preemption.save_on_preemption(choice, in_task=supervised() or restarted)


def ctx() -> TaskContext | None:
    """The running task's context; outside any task, the environment contract's or ``None``.

    The environment contract's context is made at the first call (and again when its
    variables change): in the job's leading process that claims the attempt number from the
    store and sets up the records of this process's end (see the module docs).

    Raises:
        ValueError: an environment contract variable holds an unusable value.
    """
    current = _current.get()
    if current is not None:
        return current
    global _env_context, _env_key
    key = tuple(os.environ.get(name) for name in _ENV_NAMES)
    if key != _env_key:
        context = environment_context(os.environ)
        if context is not None and context.checkpoint is not None and _life.leads():
            life = _life.begin(context.checkpoint, Preempted)
            if life is not None:
                context = dataclasses.replace(context, attempt=context.checkpoint.attempt)
                life.on_failure = context._run_failure_callbacks
        _env_context, _env_key = context, key
    return _env_context


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be a non-negative integer; got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {value!r}")
    return number


def environment_context(env: Mapping[str, str]) -> TaskContext | None:
    """Build the context the environment variables describe, or ``None`` if they describe none.

    Raises:
        ValueError: a variable holds a value that cannot be used (named in the message).
    """
    run_id: str | None = env.get(ENV_RUN_ID) or None
    attempt = _int(env, ENV_ATTEMPT)
    action = env.get(ENV_ACTION) or None
    if env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none"):
        run_id = run_id or f"torchelastic-{env['TORCHELASTIC_RUN_ID']}"
        attempt = attempt if attempt is not None else _int(env, "TORCHELASTIC_RESTART_COUNT")
    elif env.get("SLURM_JOB_ID"):
        array = env.get("SLURM_ARRAY_TASK_ID")
        run_id = run_id or f"slurm-{env['SLURM_JOB_ID']}" + (f"-{array}" if array else "")
        attempt = attempt if attempt is not None else _int(env, "SLURM_RESTART_COUNT") or 0
    elif env.get("SKYPILOT_TASK_ID"):
        run_id = run_id or "skypilot-" + "".join(
            c if c.isalnum() or c in "_.-" else "-" for c in env["SKYPILOT_TASK_ID"]
        )
    elif action is None:
        return None
    if action is None:
        action = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "script"
    task = check_name(ENV_ACTION, action)
    run = check_name(ENV_RUN_ID, run_id or DEFAULT_RUN_ID)
    root = root_from(env)
    checkpoint = Checkpoint(f"{root.rstrip('/')}/{task}/{run}", attempt=attempt)
    return TaskContext(
        task=task, run_id=run, action=f"{task}/{run}", attempt=attempt, retries=0,
        checkpoint=checkpoint,
    )


# -- SIGTERM ------------------------------------------------------------------------------


def _on_preempt(notice: preemption.Notice) -> None:
    """A preemption signal outside :func:`taskpoint.preemption.deferred`: run the attempt's
    ``on_preempt`` callbacks, then end it."""
    context = ctx()
    life = None if in_task() else _life.current()
    if life is not None:  # first, so a kill at the grace period's end finds it recorded
        life.preempted(f"received {notice.signal}; running the on_preempt callbacks")
    if context is not None:
        context._run_preempt_callbacks()
    raise Preempted(f"received signal {notice.signal}; preempt callbacks ran")


def install_sigterm_handler() -> bool:
    """Route SIGTERM to the current context's ``on_preempt`` callbacks (see
    :func:`taskpoint.preemption.install`, which composes it with other handlers).

    Only possible from the main thread; returns whether the handler is in place.

    Raises:
        ValueError: ``TASKPOINT_GRACE_PERIOD`` is set to something other than seconds.
    """
    return preemption.install(_on_preempt)

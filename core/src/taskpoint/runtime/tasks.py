"""``TaskEnvironment`` and its ``task`` decorator: run a function as a retried action.

Example::

    import taskpoint

    env = taskpoint.TaskEnvironment(name="train")

    @env.task(retries=3)
    def train(steps: int = 100) -> int:
        ckpt = taskpoint.ctx().checkpoint
        prev = ckpt.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        for step in range(start, steps):
            ...
            ckpt.save_sync(str(step + 1).encode())
        return steps

    train()     # attempt 0, then up to 3 retries, each resuming from the checkpoint

Where checkpoints go, first match wins: ``TaskEnvironment(root=...)``, the environment
variable ``TASKPOINT_ROOT``, then ``.taskpoint/checkpoints`` under the working directory.
Each call of a task is one action at ``<root>/<env>.<function>/<run_id>/``; a new run id
is made per call unless ``TaskEnvironment(run_id=...)`` or ``TASKPOINT_RUN_ID`` names one,
which re-attaches to that run's checkpoints.

Every attempt claims its number from the action's store as it starts, so a run that an
orchestrator restarts in a new process (a Kubernetes Job, a SLURM requeue) goes on counting:
``ctx().attempt`` counts the run's attempts in every process, a retry in the same process
takes the next number, and an earlier process that died without recording its end is
recorded as died by the next one. ``retries`` is the budget of each call (each process).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timezone
from typing import Any, Literal, ParamSpec, TypeVar, overload

from taskpoint import preemption, progress
from taskpoint.checkpoint.checkpoint import Checkpoint
from taskpoint.errors import CheckpointError, TaskAttemptError
from taskpoint.format.archive import check_codec
from taskpoint.format.history import Outcome
from taskpoint.runtime import _isolation, _life, step_boundary
from taskpoint.runtime._life import format_error
from taskpoint.runtime.context import (
    ENV_RUN_ID,
    Preempted,
    TaskContext,
    _current,
    install_sigterm_handler,
    root_from,
)
from taskpoint.runtime.names import check_name
from taskpoint.store.store import Store, check_location

__all__ = ["Isolation", "TaskEnvironment", "new_run_id"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

Isolation = Literal["inline", "process"]
ISOLATIONS: tuple[Isolation, ...] = ("inline", "process")

def new_run_id() -> str:
    """A fresh run id: UTC time to the second plus random hex, so ids sort by start."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


class TaskEnvironment:
    """A named group of tasks sharing checkpoint settings.

    Args:
        name: the environment's name, the first part of each task's name.
        root: where checkpoints go (any fsspec URL or local path); see the module docs.
        run_id: attach every call to this run instead of starting a new one.
        checkpoints: ``False`` makes ``ctx().checkpoint`` ``None`` in its tasks.
        keep: committed checkpoints kept per action, newest first.
        codec: directory compression, ``"gzip"``, ``"zstd"`` or ``"none"``.
        storage_options: passed to the fsspec filesystem (credentials, endpoints).

    Raises:
        ValueError: a name or run id with characters unfit for a path, ``keep`` < 1, or an
            unknown codec.
    """

    def __init__(
        self,
        name: str,
        *,
        root: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        checkpoints: bool = True,
        keep: int = 1,
        codec: str = "gzip",
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = check_name("TaskEnvironment name", name)
        self.root = check_location("root", root) if root is not None else None
        self.run_id = check_name("run_id", run_id) if run_id is not None else None
        self.checkpoints = checkpoints
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int of at least 1; got {keep!r}")
        self.keep = keep
        self.codec = check_codec(codec)
        self.storage_options = dict(storage_options or {})

    def __repr__(self) -> str:
        return f"TaskEnvironment(name={self.name!r}, root={self.root!r})"

    def resolve_root(self) -> str:
        """The checkpoint root in force now: argument, ``TASKPOINT_ROOT``, or the default."""
        return self.root if self.root is not None else root_from(os.environ)

    def resolve_run_id(self) -> str:
        """The run id for a new call: argument, ``TASKPOINT_RUN_ID``, or a fresh one."""
        if self.run_id is not None:
            return self.run_id
        from_env = os.environ.get(ENV_RUN_ID)
        if from_env:
            return check_name(ENV_RUN_ID, from_env)
        return new_run_id()

    @overload
    def task(self, fn: Callable[P, R], /) -> Callable[P, R]: ...

    @overload
    def task(
        self,
        *,
        retries: int = 0,
        backoff: float = 0.1,
        name: str | None = None,
        isolation: Isolation = "inline",
    ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    def task(  # type: ignore[misc]  # mypy cannot match ParamSpec overloads
        self,
        fn: Callable[P, R] | None = None,
        /,
        *,
        retries: int = 0,
        backoff: float = 0.1,
        name: str | None = None,
        isolation: Isolation = "inline",
    ) -> Callable[P, R] | Callable[[Callable[P, R]], Callable[P, R]]:
        """Make ``fn`` a task: each call runs as one action with up to ``retries`` retries.

        Args:
            retries: how many times a failed attempt is retried (0: run once).
            backoff: seconds before the first retry; doubles per retry, capped at 30 s.
            name: the task's function name in the store (default: ``fn.__name__``).
            isolation: ``"inline"`` runs attempts in this process; ``"process"`` runs each
                in a fresh child process, so a crash, ``os._exit``, OOM kill or signal is a
                failed attempt that is retried too. Arguments and the return value must
                then be picklable, and ``fn`` importable from its module.

        The last attempt's exception propagates unchanged (for process isolation: the
        child's exception with its traceback text as a note, or
        :class:`~taskpoint.TaskAttemptError` when the child died). ``KeyboardInterrupt``,
        ``SystemExit`` and other non-``Exception`` errors are never retried.
        Works on ``def`` and ``async def`` functions.

        Raises:
            ValueError: ``retries`` or ``backoff`` is negative, or ``isolation`` unknown.
        """
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative int; got {retries!r}")
        if backoff < 0:
            raise ValueError(f"backoff must be >= 0 seconds; got {backoff!r}")
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}; got {isolation!r}")

        def decorate(func: Callable[P, R]) -> Callable[P, R]:
            task_name = f"{self.name}.{check_name('task name', name or func.__name__)}"
            runner = Runner(self, task_name, func, retries, backoff, isolation)
            wrapper: Any = runner.wrap_async() if runner.is_async else runner.wrap_sync()
            functools.update_wrapper(wrapper, func)
            wrapper.__taskpoint_runner__ = runner
            return wrapper  # type: ignore[no-any-return]

        return decorate(fn) if fn is not None else decorate


class Runner:
    """The attempt loop of one task, written once for sync and async tasks.

    ``taskpoint run`` reaches it through the decorated function's ``__taskpoint_runner__``
    to run a task with other settings (:meth:`with_options`).
    """

    def __init__(
        self,
        env: TaskEnvironment,
        task: str,
        func: Callable[..., Any],
        retries: int,
        backoff: float,
        isolation: Isolation,
    ) -> None:
        self.env = env
        self.task = task
        self.func = func
        self.retries = retries
        self.backoff = backoff
        self.isolation = isolation
        self.is_async = inspect.iscoroutinefunction(func)

    def with_options(
        self,
        *,
        retries: int | None = None,
        isolation: Isolation | None = None,
        root: str | None = None,
        run_id: str | None = None,
    ) -> Runner:
        """A copy running with the given settings in place of the task's own."""
        env = self.env
        if root is not None or run_id is not None:
            env = copy.copy(env)
            env.root = root if root is not None else env.root
            env.run_id = check_name("run_id", run_id) if run_id is not None else env.run_id
        return Runner(
            env,
            self.task,
            self.func,
            self.retries if retries is None else retries,
            self.backoff,
            self.isolation if isolation is None else isolation,
        )

    def _checkpoint(self, run_id: str, attempt: int | None) -> Checkpoint:
        return Checkpoint(
            self.action_url(run_id),
            attempt=attempt,
            keep=self.env.keep,
            codec=self.env.codec,
            storage_options=self.env.storage_options,
        )

    def context(self, run_id: str, attempt: int) -> TaskContext:
        """The context attempt ``attempt`` of run ``run_id`` runs with."""
        checkpoint = self._checkpoint(run_id, attempt) if self.env.checkpoints else None
        return self._make_context(run_id, attempt, checkpoint)

    def claim(self, run_id: str, previous: int | None) -> TaskContext:
        """Start the next attempt of run ``run_id``: claim its number from the store (after
        every attempt an earlier process of the run made, and after ``previous``, this
        process's last one), record its start and record earlier attempts that died
        without an end record; return its context.

        Without checkpoints the attempts count from 0 in each process. When the store
        cannot be reached, the attempt takes the number after ``previous`` (0 first) and
        says so at WARNING: the failure is the first save's to report.
        """
        after = 0 if previous is None else previous + 1
        if not self.env.checkpoints:
            return self.context(run_id, after)
        if not _life.leads():  # another rank of a job: its leading rank claims and records
            store = Store(self.action_url(run_id), self.env.storage_options)
            number = _life.follow_claim(store, previous)
            return self._make_context(run_id, number, self._checkpoint(run_id, number))
        checkpoint = self._checkpoint(run_id, None)
        try:
            checkpoint.mark_started()
            attempt = checkpoint.attempt
        except CheckpointError as exc:
            attempt = None
            log.warning("%s/%s: could not claim an attempt number (%s); numbering this one %d",
                        self.task, run_id, exc, after)
        if attempt is None or attempt < after:
            checkpoint = self._checkpoint(run_id, after)
            checkpoint.mark_started()
            attempt = after
        return self._make_context(run_id, attempt, checkpoint)

    def _make_context(
        self, run_id: str, attempt: int, checkpoint: Checkpoint | None
    ) -> TaskContext:
        return TaskContext(
            task=self.task,
            run_id=run_id,
            action=f"{self.task}/{run_id}",
            attempt=attempt,
            retries=self.retries,
            checkpoint=checkpoint,
        )

    def action_url(self, run_id: str) -> str:
        """Where run ``run_id`` of this task keeps its checkpoints."""
        return f"{self.env.resolve_root().rstrip('/')}/{self.task}/{run_id}"

    def _delay(self, attempt: int) -> float:
        return float(min(30.0, self.backoff * (2 ** (attempt - 1))))

    def _failed(self, context: TaskContext, exc: BaseException, tries: int) -> bool:
        """Log a failed attempt, the ``tries``-th of this call (from 0); whether another
        attempt follows. The log names the attempt and the last number this call's retries
        may reach."""
        again = (
            isinstance(exc, Exception)
            and not getattr(exc, "__taskpoint_fatal__", False)
            and tries < self.retries
        )
        attempt = context.attempt or 0
        log.warning(
            "%s attempt %d/%d failed: %s: %s%s",
            context.action, attempt, attempt - tries + self.retries, type(exc).__name__, exc,
            "; retrying" if again else "; no retries left",
        )
        return again

    def settle(self, context: TaskContext, failed: bool) -> None:
        """Run the attempt's :meth:`~TaskContext.on_end` callbacks (adapters wait there for
        their uploads in flight), then wait for its background saves; their errors fail a
        successful attempt.

        A failed attempt waits for them only so long
        (:func:`~taskpoint.runtime.step_boundary.settle_time`, from now: until the grace
        period's end after a preemption signal, else a fixed time). A save
        still uploading then is left to go on; the attempt ends (and is recorded) without
        it, and until it commits the newest checkpoint is the one before it.
        """
        waits: list[Callable[[], object]] = [context._run_end_callbacks]
        if context.checkpoint is not None:
            checkpoint = context.checkpoint
            if failed:
                deadline = time.monotonic() + step_boundary.settle_time()
                waits.append(lambda: self._wait_bounded(context, checkpoint, deadline))
            else:
                waits.append(checkpoint.wait)
        error: Exception | None = None
        for wait in waits:  # all of them, whatever the first raised
            try:
                wait()
            except Exception as exc:
                error = error or exc
        if error is None:
            return
        if not failed:
            raise error
        log.warning("%s: a background save of the failed attempt failed too: %s",
                    context.action, error)

    @staticmethod
    def _wait_bounded(context: TaskContext, checkpoint: Checkpoint, deadline: float) -> None:
        """Wait for ``checkpoint``'s background saves until ``deadline``
        (``time.monotonic()``); say so when one still uploads then."""
        started = time.monotonic()
        if not checkpoint.wait(max(0.0, deadline - started)):
            log.warning(
                "%s: a background save had not committed after %.1f s; the attempt ends "
                "without it (until it commits, the newest checkpoint is the one before it)",
                context.action, time.monotonic() - started,
            )

    def _finish(self, context: TaskContext, state: str) -> None:
        if context.checkpoint is not None:
            context.checkpoint.mark_finished(state, attempts=(context.attempt or 0) + 1)

    @staticmethod
    def begin(context: TaskContext) -> None:
        """Prepare this process for the attempt of ``context``: forget an earlier
        attempt's preemption notice and put the SIGTERM handler in place."""
        preemption.reset()
        progress.reset()
        install_sigterm_handler()

    @staticmethod
    def returned(context: TaskContext) -> None:
        """The attempt's function returned: raise :class:`Preempted` if a preemption
        signal reached it, since what it returned after one is not a finished result
        (a framework that saved and stopped early on the signal returns normally)."""
        notice = preemption.notice()
        if notice is not None:
            raise Preempted(
                f"attempt {context.attempt} of {context.action} received {notice.signal} "
                "and returned after it; it counts as preempted, not succeeded"
            )

    def _attempt_inline(self, context: TaskContext, args: Any, kwargs: Any) -> Any:
        token = _current.set(context)
        try:
            self.begin(context)
            result = self.func(*args, **kwargs)
            self.returned(context)
        except BaseException as exc:
            context._run_failure_callbacks(exc)
            self.settle(context, failed=True)
            raise
        finally:
            _current.reset(token)
        self.settle(context, failed=False)
        return result

    @staticmethod
    def started(context: TaskContext) -> None:
        """Record that the attempt of ``context`` started, in the process that runs it."""
        if context.checkpoint is not None and _life.leads():
            context.checkpoint.mark_started()

    @staticmethod
    def _ended(context: TaskContext, exc: BaseException | None) -> None:
        """Record the attempt's outcome in the run history (on the job's leading rank)."""
        if context.checkpoint is None or not _life.leads():
            return
        if exc is None:
            context.checkpoint.mark_ended("succeeded")
            return
        outcome: Outcome = "failed"
        if isinstance(exc, Preempted):
            outcome = "preempted"
        elif isinstance(exc, TaskAttemptError):
            outcome = "crashed"
        context.checkpoint.mark_ended(
            outcome, f"{type(exc).__name__}: {exc}"[:2000], traceback=format_error(exc)
        )

    def _attempt(self, context: TaskContext, args: Any, kwargs: Any) -> Any:
        log.info("%s attempt %d/%d starting", context.action, context.attempt, self.retries)
        if self.isolation == "process":
            progress.reset()  # the child reports the step it reached with its outcome
            env = self.env
            options = {
                "name": env.name, "root": env.resolve_root(), "run_id": context.run_id,
                "checkpoints": env.checkpoints, "keep": env.keep, "codec": env.codec,
                "storage_options": env.storage_options,
            }
            return _isolation.run_attempt(
                self.func, self.task, options, self.retries, self.backoff, context, args, kwargs
            )
        return self._attempt_inline(context, args, kwargs)

    async def _attempt_async(self, context: TaskContext, args: Any, kwargs: Any) -> Any:
        if self.isolation == "process":
            return await asyncio.to_thread(self._attempt, context, args, kwargs)
        log.info("%s attempt %d/%d starting", context.action, context.attempt, self.retries)
        token = _current.set(context)
        try:
            self.begin(context)
            result = await self.func(*args, **kwargs)
            self.returned(context)
        except BaseException as exc:
            await asyncio.to_thread(context._run_failure_callbacks, exc)
            await asyncio.to_thread(self.settle, context, True)
            raise
        finally:
            _current.reset(token)
        await asyncio.to_thread(self.settle, context, False)
        return result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task (awaitable for async tasks when inline)."""
        return self.wrap_async()(*args, **kwargs) if self.is_async else self.wrap_sync()(*args, **kwargs)

    def wrap_sync(self) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            run_id = self.env.resolve_run_id()
            previous: int | None = None
            for tries in range(self.retries + 1):
                context = self.claim(run_id, previous)
                previous = context.attempt
                try:
                    result = self._attempt(context, args, kwargs)
                except BaseException as exc:
                    self._ended(context, exc)
                    if not self._failed(context, exc, tries):
                        self._finish(context, "failed")
                        raise
                else:
                    self._ended(context, None)
                    self._finish(context, "succeeded")
                    return result
                time.sleep(self._delay(tries + 1))
            raise AssertionError("unreachable")  # pragma: no cover

        return run

    def wrap_async(self) -> Callable[..., Awaitable[Any]]:
        async def run(*args: Any, **kwargs: Any) -> Any:
            run_id = self.env.resolve_run_id()
            previous: int | None = None
            for tries in range(self.retries + 1):
                context = self.claim(run_id, previous)
                previous = context.attempt
                try:
                    result = await self._attempt_async(context, args, kwargs)
                except BaseException as exc:
                    self._ended(context, exc)
                    if not self._failed(context, exc, tries):
                        self._finish(context, "failed")
                        raise
                else:
                    self._ended(context, None)
                    self._finish(context, "succeeded")
                    return result
                await asyncio.sleep(self._delay(tries + 1))
            raise AssertionError("unreachable")  # pragma: no cover

        return run


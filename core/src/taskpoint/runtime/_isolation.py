"""Process-isolated attempts: each attempt of a task runs in a fresh Python process.

The parent pickles what the attempt needs (where to import the task from, its arguments,
its context) into a private temporary folder, starts ``python -m taskpoint.runtime._child``,
and reads the outcome back. A child that dies by a signal or exits non-zero without an
outcome is a failed attempt. SIGTERM sent to the parent is forwarded to the child, so
``on_preempt`` callbacks run where the training state lives.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

from taskpoint import _scratch, progress
from taskpoint.errors import TaskAttemptError

if TYPE_CHECKING:
    from taskpoint.runtime.context import TaskContext

__all__ = ["FILE_MODULE", "Outcome", "Spec", "import_task_module", "report_error", "run_attempt"]

FILE_MODULE = "__taskpoint_task_module__"


@dataclass(frozen=True)
class Spec:
    module: str
    module_file: str | None
    qualname: str
    sys_path: list[str]
    cwd: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    context: dict[str, Any]
    env: dict[str, Any]
    retries: int
    backoff: float


@dataclass(frozen=True)
class Outcome:
    ok: bool
    value: Any = None
    error: BaseException | None = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    fatal: bool = False
    step: int | None = field(default_factory=progress.current_step)  # the attempt reached


def _locate(func: Any) -> tuple[str, str | None, str]:
    module = sys.modules.get(func.__module__)
    module_file = getattr(module, "__file__", None)
    qualname = func.__qualname__
    if "<locals>" in qualname:
        raise TypeError(
            f"task {qualname!r} is defined inside a function; a process-isolated task must be "
            "importable from its module (define it at module level)"
        )
    return func.__module__, module_file, qualname


def run_attempt(
    func: Any,
    task: str,
    env: dict[str, Any],
    retries: int,
    backoff: float,
    context: TaskContext,
    args: Any,
    kwargs: Any,
) -> Any:
    """Run one attempt of the task ``func`` in a child process and return its result.

    Args:
        func: the task's function, importable from its module.
        task: the task's name, for messages.
        env: the child's ``TaskEnvironment`` arguments (``name``, ``root``, ``run_id``,
            ``checkpoints``, ``keep``, ``codec``, ``storage_options``).
        retries: the task's retry count, passed on to the child's runner.
        backoff: the task's backoff, passed on to the child's runner.
        context: this attempt's context.
        args: the task's positional arguments.
        kwargs: the task's keyword arguments.

    Raises:
        TypeError: the arguments cannot be pickled, or the task is not importable.
        TaskAttemptError: the child died without an outcome.
        Exception: whatever the task raised in the child (with its traceback as a note).
    """
    module, module_file, qualname = _locate(func)
    spec = Spec(
        module=module,
        module_file=module_file,
        qualname=qualname,
        sys_path=list(sys.path),
        cwd=os.getcwd(),
        args=tuple(args),
        kwargs=dict(kwargs),
        context={"run_id": context.run_id, "attempt": context.attempt},
        env=dict(env),
        retries=retries,
        backoff=backoff,
    )
    try:
        blob = pickle.dumps(spec)
    except Exception as exc:
        raise TypeError(
            f"arguments of process-isolated task {task!r} must be picklable: {exc}"
        ) from exc
    # Owned: this process killed while the attempt runs leaves the folder (the pickled
    # arguments) to the next process's sweep.
    tmp = _scratch.scratch_folder()
    try:
        spec_path, outcome_path = tmp / "spec.pkl", tmp / "outcome.pkl"
        spec_path.write_bytes(blob)
        spec_path.chmod(0o600)
        returncode = _run_child(spec_path, outcome_path)
        outcome = _read_outcome(outcome_path)
    finally:
        _scratch.remove(tmp)
    if outcome is not None and outcome.step is not None:
        progress.report_step(outcome.step)  # this process records the attempt's end
    if outcome is None:
        raise TaskAttemptError(
            f"attempt {context.attempt} of {context.action} died: {_describe(returncode)}",
            returncode=returncode,
        )
    if outcome.ok:
        return outcome.value
    error = outcome.error
    if error is None:
        raise TaskAttemptError(
            f"attempt {context.attempt} of {context.action} raised {outcome.error_type}: "
            f"{outcome.message} (the exception could not be sent back)\n{outcome.traceback}",
            returncode=returncode,
            traceback=outcome.traceback,
        )
    if hasattr(error, "add_note"):
        error.add_note(f"raised in the attempt's child process:\n{outcome.traceback}")
    if outcome.fatal:
        error.__taskpoint_fatal__ = True  # type: ignore[attr-defined]  # no retry can fix it
    raise error


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"


def _run_child(spec_path: Path, outcome_path: Path) -> int:
    child = subprocess.Popen(
        [sys.executable, "-m", "taskpoint.runtime._child", str(spec_path), str(outcome_path)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    forwarded = False
    previous: Any = None

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal forwarded
        forwarded = True
        child.send_signal(signum)

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        previous = signal.signal(signal.SIGTERM, forward)
    try:
        return child.wait()
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _read_outcome(path: Path) -> Outcome | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        outcome = pickle.loads(data)
    except Exception:
        return None
    return outcome if isinstance(outcome, Outcome) else None


# -- the child ------------------------------------------------------------------------


def import_task_module(spec: Spec) -> ModuleType:
    if spec.module not in ("__main__", FILE_MODULE):
        try:
            return importlib.import_module(spec.module)
        except ImportError:
            if spec.module_file is None:
                raise
    if spec.module_file is None:
        raise ImportError(f"cannot import the task's module {spec.module!r}: it has no file")
    module_spec = importlib.util.spec_from_file_location(FILE_MODULE, spec.module_file)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {spec.module_file}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[FILE_MODULE] = module
    if spec.module == "__main__":
        sys.modules.setdefault("__mp_main__", module)
    module_spec.loader.exec_module(module)
    return module


def report_error(outcome_path: str, exc: BaseException, fatal: bool = False) -> int:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    outcome = Outcome(
        ok=False, error=exc, error_type=type(exc).__name__, message=str(exc),
        traceback=text, fatal=fatal,
    )
    try:
        data = pickle.dumps(outcome)
        pickle.loads(data)
    except Exception:
        outcome = Outcome(
            ok=False, error_type=type(exc).__name__, message=str(exc), traceback=text,
            fatal=fatal,
        )
        data = pickle.dumps(outcome)
    Path(outcome_path).write_bytes(data)
    return 1


"""Entry point of a process-isolated attempt: ``python -m taskpoint.runtime._child SPEC OUTCOME``.

Kept apart from ``_isolation`` so that running it as ``__main__`` does not create a second
copy of the classes the outcome is pickled with, and so that the parent's side
(:mod:`taskpoint.runtime._isolation`, which :mod:`taskpoint.runtime.tasks` uses) never imports the
runtime back: only the child, at the top of the layers, builds a ``TaskEnvironment``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from taskpoint.runtime._isolation import Outcome, Spec, import_task_module, report_error
from taskpoint.runtime.context import _current
from taskpoint.runtime.tasks import TaskEnvironment

__all__ = ["child_main"]


def child_main(spec_path: str, outcome_path: str) -> int:
    """Run the attempt the pickled spec at ``spec_path`` describes; write its outcome.

    Returns:
        The process exit status: 0 when the task returned, 1 when it raised (either way
        the outcome file says what happened).
    """
    spec: Spec = pickle.loads(Path(spec_path).read_bytes())
    os.chdir(spec.cwd)
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        target: Any = import_task_module(spec)
        for part in spec.qualname.split("."):
            target = getattr(target, part)
        runner = target.__taskpoint_runner__
        env = TaskEnvironment(
            spec.env["name"],
            root=spec.env["root"],
            run_id=spec.env["run_id"],
            checkpoints=spec.env["checkpoints"],
            keep=spec.env["keep"],
            codec=spec.env["codec"],
            storage_options=spec.env["storage_options"],
        )
        runner = runner.with_options(retries=spec.retries, isolation="inline")
        runner.env = env
        context = runner.context(spec.context["run_id"], spec.context["attempt"])
        # The runner recorded the attempt before starting this process; the record names
        # the process the attempt runs in, so this one writes it again with its own pid.
        runner.started(context)
        token = _current.set(context)
        try:
            runner.begin(context)
            value = runner.func(*spec.args, **spec.kwargs)
            if asyncio.iscoroutine(value):
                value = asyncio.run(value)
            runner.returned(context)
        except BaseException as exc:
            context._run_failure_callbacks(exc)
            runner.settle(context, failed=True)
            raise
        finally:
            _current.reset(token)
        runner.settle(context, failed=False)
    except BaseException as exc:  # reported to the parent, which decides on retries
        return report_error(outcome_path, exc)
    try:
        data = pickle.dumps(Outcome(ok=True, value=value))
    except Exception as exc:
        error = TypeError(f"the task's return value cannot be pickled: {exc}")
        return report_error(outcome_path, error, fatal=True)
    Path(outcome_path).write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1], sys.argv[2]))

"""The runtime layer: tasks run as retried actions, and what a running task knows.

- :mod:`taskpoint.runtime.tasks`: :class:`~taskpoint.TaskEnvironment` and its ``task``
  decorator, attempts and retries;
- :mod:`taskpoint.runtime._isolation` and :mod:`taskpoint.runtime._child`: an attempt in a
  fresh Python process, the parent's side and the child's;
- :mod:`taskpoint.runtime.context`: :func:`~taskpoint.ctx`, inside a task or from the
  environment outside one;
- :mod:`taskpoint.runtime.step_boundary`: a plain loop's step boundaries, where a
  preemption signal becomes a save;
- :mod:`taskpoint.runtime.preemption_stop`: the preemption stop every adapter shares (defer,
  agree across ranks, finish the upload in flight, save if it fits, record, raise);
- :mod:`taskpoint.runtime.names`: the rule for task, run and environment names.

It hands each attempt a :class:`~taskpoint.Checkpoint` (:mod:`taskpoint.checkpoint`) and
records the attempt in the run history (:mod:`taskpoint.format.history`).

``taskpoint.runtime`` was one module before it became this package (its
:class:`~taskpoint.TaskEnvironment` is now in :mod:`taskpoint.runtime.tasks`); the names it
listed are importable from here still.
"""

from taskpoint.runtime.tasks import Isolation, TaskEnvironment, new_run_id

__all__ = ["Isolation", "TaskEnvironment", "new_run_id"]

"""taskpoint: intra-task checkpoints that survive crashes, preemption and retries.

Inside a task, ``taskpoint.ctx().checkpoint`` saves in-progress state to a store and loads
the newest committed state back on the next attempt::

    import taskpoint

    env = taskpoint.TaskEnvironment(name="demo")

    @env.task(retries=3)
    def count(n: int = 10) -> int:
        ckpt = taskpoint.ctx().checkpoint
        prev = ckpt.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        for i in range(start, n):
            ckpt.save_sync(str(i + 1).encode())
        return n
"""

from taskpoint._types import CheckpointLike
from taskpoint.checkpoint.checkpoint import Checkpoint, SaveInput, latest_checkpoint
from taskpoint.distributed._parts import PartsCommit
from taskpoint.distributed.coordination import Coordinator, StoreCoordinator
from taskpoint.errors import (
    CheckpointClosedError,
    CheckpointCoordinationError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointRestoreError,
    CheckpointSaveError,
    CheckpointStoreError,
    CheckpointUnsafeError,
    TaskAttemptError,
    TaskpointWarning,
)
from taskpoint.format.history import SaveStats
from taskpoint.progress import report_step
from taskpoint.runtime.context import Preempted, TaskContext, ctx
from taskpoint.runtime.interval import IntervalChoice, SaveInterval
from taskpoint.runtime.tasks import TaskEnvironment
from taskpoint.store.store import RetryPolicy
from taskpoint.versions import require_version

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointClosedError",
    "CheckpointCoordinationError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointLike",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointStoreError",
    "CheckpointUnsafeError",
    "Coordinator",
    "IntervalChoice",
    "PartsCommit",
    "Preempted",
    "RetryPolicy",
    "SaveInput",
    "SaveInterval",
    "SaveStats",
    "StoreCoordinator",
    "TaskAttemptError",
    "TaskContext",
    "TaskEnvironment",
    "TaskpointWarning",
    "__version__",
    "ctx",
    "latest_checkpoint",
    "report_step",
    "require_version",
]

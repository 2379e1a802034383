"""taskpoint-pytorch: exact resume of plain PyTorch training loops.

``TaskpointState`` bundles what a loop needs back after a crash: models, optimizers, LR
schedulers, AMP grad scalers, your counters and extra state, and the Python, NumPy, torch
and CUDA RNG states. ``save``/``save_sync`` commit it through a :class:`taskpoint.Checkpoint`
(or any ``CheckpointLike``); ``restore``/``restore_sync`` load it back, with
``torch.load(weights_only=True)``, and return where to resume (``None`` on the first
attempt)::

    import taskpoint
    import torch
    from taskpoint_pytorch import TaskpointState

    env = taskpoint.TaskEnvironment(name="train")

    @env.task(retries=3)
    def train(epochs: int = 10) -> float:
        checkpoint = taskpoint.ctx().checkpoint
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        state = TaskpointState(model, opt)

        resume = state.restore_sync(checkpoint)       # None on the first attempt
        start = resume.epoch if resume else 0
        for epoch in range(start, epochs):
            loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.save_sync(checkpoint, epoch=epoch + 1)
        return model(torch.ones(1, 4)).item()

Each ``save_sync`` call is a step boundary. Inside a taskpoint task a SIGTERM (a spot
reclaim, a pod eviction) is noted, and the next ``save_sync`` saves at once, waits for the
commit within the grace period (``TASKPOINT_GRACE_PERIOD``) and raises
:class:`taskpoint.Preempted`: the next attempt resumes at that step, with no line added to
the loop above. Outside a task, ``TASKPOINT_SAVE_ON_PREEMPTION=1`` does the same. A loop
that saves every N steps calls ``state.save_sync(checkpoint, step=step, every=N)`` at every
step, so it stops at the next step rather than the next save.

Under ``torch.distributed`` (DDP, any backend, gloo on CPU included) every rank calls the
same methods: only global rank 0 writes and commits, the other ranks wait for the commit,
and on restore every rank loads the same bundle and its own RNG state.

``torch.distributed.checkpoint`` goes through taskpoint too, every rank uploading its own
shards and one commit for all, and downloading only the shard files its load plan reads
(``TaskpointStorageWriter``, ``TaskpointStorageReader``);
``TorchCoordinator`` lets every rank commit its own folder as one checkpoint
(``taskpoint.Checkpoint.save_part_sync``).

With a shuffling ``DataLoader``, saving at epoch boundaries resumes bit for bit: the
restored torch RNG draws the same next permutation. To save mid-epoch as well, make the
order a function of the epoch (``DistributedSampler.set_epoch``, or a ``generator=``
seeded per epoch) and skip the batches already done.
"""

from typing import TYPE_CHECKING

from taskpoint import require_version

SUPPORTED_TORCH = "torch>=2.4,<3"
"""The PyTorch releases this adapter supports, as a requirement string (also the install
hint); importing the package raises ``ImportError`` outside it."""

require_version(SUPPORTED_TORCH, adapter="taskpoint-pytorch")

from taskpoint.integration import TorchCoordinator  # noqa: E402

from taskpoint_pytorch._errors import (  # noqa: E402
    StateError,
    StateLayoutError,
    StateMismatchError,
)
from taskpoint_pytorch._layout import LAYOUT, LAYOUT_VERSION, STATE_FILE  # noqa: E402
from taskpoint_pytorch.state import ResumePoint, Stateful, TaskpointState  # noqa: E402

__version__ = "0.1.0"

_LAZY = {"TaskpointStorageReader", "TaskpointStorageWriter"}
"""Names loaded on first use: they import ``torch.distributed.checkpoint`` (about 3 s of a
restart's start-up here), which a job that does not save DCP shards never needs."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from taskpoint_pytorch import _dcp

        return getattr(_dcp, name)
    raise AttributeError(f"module 'taskpoint_pytorch' has no attribute {name!r}")


if TYPE_CHECKING:
    from taskpoint_pytorch._dcp import TaskpointStorageReader, TaskpointStorageWriter

__all__ = [
    "LAYOUT",
    "LAYOUT_VERSION",
    "STATE_FILE",
    "SUPPORTED_TORCH",
    "ResumePoint",
    "StateError",
    "StateLayoutError",
    "StateMismatchError",
    "Stateful",
    "TaskpointState",
    "TaskpointStorageReader",
    "TaskpointStorageWriter",
    "TorchCoordinator",
    "__version__",
]

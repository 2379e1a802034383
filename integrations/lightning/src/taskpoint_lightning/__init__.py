"""taskpoint for Lightning: a ``ModelCheckpoint`` that mirrors to the store, and resume.

Inside a taskpoint task (or with any :class:`taskpoint.CheckpointLike`)::

    import lightning as L
    import taskpoint
    from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path

    env = taskpoint.TaskEnvironment(name="train")

    @env.task(retries=3)
    def train() -> None:
        ckpt = taskpoint.ctx().checkpoint
        mc = TaskpointModelCheckpoint(ckpt, dirpath="ckpts", save_last=True,
                                      every_n_train_steps=50)
        trainer = L.Trainer(max_epochs=10, callbacks=[mc])
        # None on the first attempt; the newest last*.ckpt on a retry.
        trainer.fit(model, ckpt_path=resume_ckpt_path(ckpt, dirpath="ckpts"))

The callback mirrors ``dirpath`` to the store after each save Lightning finishes (on
global rank zero), and keeps the random state in the checkpoint so a resumed run matches
an uninterrupted one. For the standalone ``pytorch_lightning`` package use
``taskpoint_lightning.pytorch_lightning.TaskpointModelCheckpoint``.
"""

from taskpoint_lightning._compat import check_lightning_version

check_lightning_version()

from taskpoint_lightning.callback import RNG_STATE_KEY, TaskpointModelCheckpoint  # noqa: E402
from taskpoint_lightning.resume import resume_ckpt_path  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "RNG_STATE_KEY",
    "TaskpointModelCheckpoint",
    "__version__",
    "resume_ckpt_path",
]

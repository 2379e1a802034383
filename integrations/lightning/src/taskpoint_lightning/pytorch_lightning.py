"""``TaskpointModelCheckpoint`` for the standalone ``pytorch_lightning`` package, built on
its own ``ModelCheckpoint``::

    import pytorch_lightning as pl
    from taskpoint_lightning import resume_ckpt_path
    from taskpoint_lightning.pytorch_lightning import TaskpointModelCheckpoint

    mc = TaskpointModelCheckpoint(ckpt, dirpath="ckpts", save_last=True)
    pl.Trainer(callbacks=[mc]).fit(model, ckpt_path=resume_ckpt_path(ckpt, dirpath="ckpts"))
"""

from __future__ import annotations

from taskpoint_lightning._compat import check_lightning_version

check_lightning_version(distribution="pytorch-lightning")

from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402

from taskpoint_lightning.callback import _TaskpointMirror  # noqa: E402

__all__ = ["TaskpointModelCheckpoint"]


class TaskpointModelCheckpoint(_TaskpointMirror, ModelCheckpoint):  # type: ignore[misc]  # (its Trainer class differs)
    """:class:`taskpoint_lightning.TaskpointModelCheckpoint` for ``pytorch_lightning``.

    Same arguments and behaviour; see that class.
    """

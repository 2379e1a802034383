"""The checkpoint layer: :class:`~taskpoint.Checkpoint`, what saves and loads go through.

- :mod:`taskpoint.checkpoint.checkpoint`: :class:`~taskpoint.Checkpoint` and
  :func:`~taskpoint.latest_checkpoint`, the public face;
- :mod:`taskpoint.checkpoint._multiwriter`, :mod:`taskpoint.checkpoint._records` and
  :mod:`taskpoint.checkpoint._stored`: the methods ``Checkpoint`` inherits for saving one
  checkpoint from several processes, for its run records and for the checkpoints stored;
- :mod:`taskpoint.checkpoint._save` and :mod:`taskpoint.checkpoint._load`: the save path
  (snapshot, commit, background saves) and the load path (``Checkpoint``'s load methods,
  and finding and restoring the newest intact checkpoint);
- :mod:`taskpoint.checkpoint._uploader`, :mod:`taskpoint.checkpoint._upload_child` and
  :mod:`taskpoint.checkpoint._settle`: the process background saves run in (its handle,
  and the program it runs), and waiting for them;
- :mod:`taskpoint.checkpoint._upload_thread`: the thread background uploads run on, one at
  a time, the newest waiting one winning;
- :mod:`taskpoint.checkpoint.mirror`: the adapters' upload of a finished local folder, and
  :mod:`taskpoint.checkpoint.job_mirror`: that folder written by every rank of a job.

It writes through :mod:`taskpoint.format` to :mod:`taskpoint.store`, and runs the
multi-writer protocol of :mod:`taskpoint.distributed`; it knows nothing of tasks.

``taskpoint.checkpoint`` was one module before it became this package; the names it listed
are importable from here still.
"""

from taskpoint.checkpoint.checkpoint import Checkpoint, SaveInput, latest_checkpoint

__all__ = ["Checkpoint", "SaveInput", "latest_checkpoint"]

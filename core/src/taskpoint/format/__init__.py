"""The format layer: what a checkpoint location holds, and the rules to write and read it.

- :mod:`taskpoint.format.manifest`: the manifest, the commit record (no I/O);
- :mod:`taskpoint.format._payload`: format 1, a checkpoint as one payload (bytes, a file,
  or a directory as one archive from :mod:`taskpoint.format.archive`), written and
  restored;
- :mod:`taskpoint.format.tree` with :mod:`taskpoint.format._tree_save` and
  :mod:`taskpoint.format._tree_restore`: a directory as files stored once by content
  (format 2), helped by :mod:`taskpoint.format._digest` (checksums as bytes stream),
  :mod:`taskpoint.format._statcache` (files known unchanged) and
  :mod:`taskpoint.format._gc` (the collector paused while a tree is built);
- :mod:`taskpoint.format.retention`: which content objects no checkpoint needs, safely;
- :mod:`taskpoint.format._catalog`: the committed checkpoints at one location;
- :mod:`taskpoint.format.history`: the run history kept beside the checkpoints.

It reaches the store only through :mod:`taskpoint.store`, and knows nothing of who saves:
no coordination, no :class:`~taskpoint.Checkpoint`.
"""

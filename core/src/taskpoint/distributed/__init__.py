"""The distributed layer: several processes writing, and restoring, one checkpoint.

- :mod:`taskpoint.distributed.coordination`: how the writers talk (the
  :class:`~taskpoint.Coordinator` protocol, a store-backed implementation);
- :mod:`taskpoint.distributed.torch_coordination`: a torch job's ranks as a coordinator;
- :mod:`taskpoint.distributed._parts`: the multi-writer save, each rank's folder committed
  as one tree;
- :mod:`taskpoint.distributed.nodes`: folders on several nodes' own disks, saved as one
  checkpoint and restored to each.

It builds on :mod:`taskpoint.format` and :mod:`taskpoint.store`; :class:`~taskpoint.Checkpoint`
(:mod:`taskpoint.checkpoint.checkpoint`) runs its protocol, never the other way round.
"""

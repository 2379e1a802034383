"""The distributed layer: several processes writing, and restoring, one checkpoint.

- :mod:`taskpoint.distributed.coordination`: how the writers talk (the
  :class:`~taskpoint.Coordinator` protocol, a store-backed implementation);
- :mod:`taskpoint.distributed.torch_coordination`: a torch job's ranks as a coordinator;
- :mod:`taskpoint.distributed.torch_collectives`: which rank this process is, and the
  collectives the adapters make on the default ``torch.distributed`` group (gather,
  broadcast, barrier, gather-or-raise), exported here;
- :mod:`taskpoint.distributed._parts`: the multi-writer save, each rank's folder committed
  as one tree;
- :mod:`taskpoint.distributed.nodes`: folders on several nodes' own disks, saved as one
  checkpoint and restored to each.

It builds on :mod:`taskpoint.format` and :mod:`taskpoint.store`; :class:`~taskpoint.Checkpoint`
(:mod:`taskpoint.checkpoint.checkpoint`) runs its protocol, never the other way round.

Example (every rank of a torch job, or a lone process)::

    from taskpoint.distributed import current_ranks, gather_or_raise

    ranks = current_ranks()   # rank, local_rank, world_size, grouped
    every = gather_or_raise(ranks.rank, None, "agree")   # [0, 1, ...] on every rank
"""

from taskpoint.distributed.torch_collectives import (
    Ranks,
    all_gather_object,
    barrier,
    broadcast_from_zero,
    current_ranks,
    describe_error,
    gather_or_raise,
    is_distributed,
    raise_first_failure,
    rank_and_size,
)

__all__ = [
    "Ranks",
    "all_gather_object",
    "barrier",
    "broadcast_from_zero",
    "current_ranks",
    "describe_error",
    "gather_or_raise",
    "is_distributed",
    "raise_first_failure",
    "rank_and_size",
]

"""Re-exports :mod:`taskpoint.distributed.nodes` at its documented old path."""

from taskpoint.distributed.nodes import (
    PRIVATE_PREFIX,
    Disks,
    discard_stale_parts,
    find_disks,
    list_files,
    restore_to_every_disk,
    run_everywhere,
    stage_part,
)

__all__ = [
    "PRIVATE_PREFIX",
    "Disks",
    "discard_stale_parts",
    "find_disks",
    "list_files",
    "restore_to_every_disk",
    "run_everywhere",
    "stage_part",
]

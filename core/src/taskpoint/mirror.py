"""Re-exports :mod:`taskpoint.checkpoint.mirror` at its documented old path."""

from taskpoint.checkpoint.mirror import (
    EXIT_WAIT_S,
    FolderMirror,
    MirrorStats,
    UploadThread,
    combined_metrics,
    note_coalesced,
    settle_uploads,
    track,
    unshare,
)

__all__ = [
    "EXIT_WAIT_S",
    "FolderMirror",
    "MirrorStats",
    "UploadThread",
    "combined_metrics",
    "note_coalesced",
    "settle_uploads",
    "track",
    "unshare",
]

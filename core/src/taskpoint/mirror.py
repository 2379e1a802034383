"""Re-exports :mod:`taskpoint.checkpoint.mirror` at its documented old path."""

from taskpoint.checkpoint.mirror import (
    EXIT_WAIT_S,
    FolderMirror,
    MirrorStats,
    UploadThread,
    combined_metrics,
    settle_uploads,
    track,
    unshare,
    uploads_in_flight,
)

__all__ = [
    "EXIT_WAIT_S",
    "FolderMirror",
    "MirrorStats",
    "UploadThread",
    "combined_metrics",
    "settle_uploads",
    "track",
    "unshare",
    "uploads_in_flight",
]

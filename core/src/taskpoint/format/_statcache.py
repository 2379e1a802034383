"""Files whose content taskpoint knows, trusted unchanged while their stat says so.

As git's index and rsync do, a format-2 save skips reading a file whose ``(device, inode,
mode, size, mtime, ctime)`` are those it recorded when it last read that file for a
committed save of the same :class:`taskpoint.Checkpoint`; a restore into a folder skips
hashing a file whose stat is the one recorded when taskpoint itself wrote it there. Any
other file is read and hashed, as is every file when the cache is empty (a new process).

Why a recorded stat is safe to trust:

- Every write to a file (``write``, ``truncate``, a shared memory map once its page is
  written back) sets its mtime and ctime to the current time, and ``utime``, ``chmod``,
  ``link`` and ``rename`` set its ctime. A replaced file (write-and-rename) has another
  inode. So a file changed after its stat was recorded has another stat, unless the
  change fell in the same timestamp tick as the recorded times ("racy git").
- Timestamps come from a clock that lags the real one by at most one tick (a jiffy on
  Linux, at most 10 ms; whole seconds on file systems that keep no finer times, 2 s on
  FAT). A record is therefore kept only when the times it trusts lie at least
  :data:`SLACK_NS` (:data:`COARSE_SLACK_NS` for times in whole milliseconds) before a
  clock reading taken before the file was read or written: any change after that reading
  stamps a later time.
- For a save the trusted times are mtime and ctime, read before the file is read; a file
  whose stat differs after reading it (changed while it was read) is not recorded. The
  record is kept only once the save committed, and a later save uses it only while every
  object its blobs lie in is referenced by a committed manifest and not known damaged.
- For a restore the trusted time is the mtime taskpoint set (the checkpoint's), and a
  record is made only when the file still has that mtime and its size: a later write
  stamps the current time instead. (Its ctime is the restore's own, so it only has to
  stay equal.)

What a stat cannot see, no tool relying on one sees either: a write through a memory
map whose pages have not been written back yet (``msync`` first), a file changed and then
given back its old times within the same clock tick on purpose, a clock stepped backwards,
and, on a network file system, changes made on another machine that this machine's
attribute cache has not caught up with, or times from a server whose clock lags this one.
The records live in memory, per checkpoint object and per folder, and go with it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from taskpoint.format._gc import paused
from taskpoint.format.manifest import Entry

__all__ = [
    "COARSE_SLACK_NS", "SLACK_NS", "ContentKey", "Record", "StatCache", "StatKey", "content_key",
    "now_ns", "settled", "stat_key",
]

SLACK_NS = 100_000_000
"""How far before the clock a trusted time must lie (fine-grained timestamps: ten times
the coarsest Linux tick)."""
COARSE_SLACK_NS = 2_000_000_000
"""The same for times in whole milliseconds or coarser (FAT keeps 2 s)."""

StatKey = tuple[int, int, int, int, int, int]
ContentKey = tuple[int, int, int, int]


def stat_key(st: os.stat_result) -> StatKey:
    """What must stay equal for a file to count as unchanged."""
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def content_key(st: os.stat_result) -> ContentKey:
    """What a file's content cannot change without changing: ``(device, inode, size, mtime)``.

    Unlike :func:`stat_key` it leaves out the ctime, which linking or unlinking another
    name of the file also sets.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def now_ns() -> int:
    """The clock reading that :func:`settled` compares file times against."""
    return time.time_ns()


def _slack(st: os.stat_result) -> int:
    return COARSE_SLACK_NS if st.st_ctime_ns % 1_000_000 == 0 else SLACK_NS


def settled(st: os.stat_result, clock: int, *, ctime: bool = True) -> bool:
    """Whether any change to the file after ``clock`` must change ``st``'s times."""
    before = clock - _slack(st)
    return st.st_mtime_ns < before and (not ctime or st.st_ctime_ns < before)


@dataclass(frozen=True)
class Record:
    """A file's stat when its content was known to be ``entry``'s."""

    key: StatKey
    entry: Entry


class StatCache:
    """Records by folder (absolute path) and path within it; safe across threads."""

    def __init__(self) -> None:
        self._folders: dict[str, dict[str, Record]] = {}
        self._lock = threading.Lock()

    def lookup(self, root: Path, rel: str, st: os.stat_result) -> Entry | None:
        """The entry recorded for ``root/rel`` if its stat is still ``st``; else ``None``."""
        with self._lock:
            record = self._folders.get(os.path.abspath(root), {}).get(rel)
        if record is None or record.key != stat_key(st):
            return None
        return record.entry

    def replace(self, root: Path, records: dict[str, Record]) -> None:
        """Make ``records`` what is known of the folder ``root``."""
        with self._lock:
            self._folders[os.path.abspath(root)] = records

    def forget(self, root: Path) -> None:
        with self._lock:
            self._folders.pop(os.path.abspath(root), None)

    def record_restored(self, root: Path, entries: Iterable[Entry], clock: int) -> None:
        """Record the files of ``entries`` that a restore just wrote under ``root``.

        ``clock`` was read before the restore wrote anything. A file is recorded only if
        it still has the entry's size and mtime, and that mtime is settled (see the module
        docstring).
        """
        records: dict[str, Record] = {}
        prefix = os.path.join(root, "")
        with paused():  # a record per file: see taskpoint.format._gc
            for entry in entries:
                if entry.type != "file":
                    continue
                try:
                    st = os.lstat(prefix + entry.path)  # a relative path: the restore's
                except OSError:
                    continue
                if (
                    st.st_size == entry.size
                    and st.st_mtime_ns == entry.mtime_ns
                    and settled(st, clock, ctime=False)
                ):
                    records[entry.path] = Record(stat_key(st), entry)
        self.replace(root, records)

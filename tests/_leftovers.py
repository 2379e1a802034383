"""What a finished training run must not leave running: taskpoint's threads and the upload
process (for the adapters' end-of-training tests)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from taskpoint.checkpoint import _uploader

ENDED_WITHIN_S = _uploader.IDLE_EXIT_S - 2
"""How long the process and threads may take to end after training: well under the idle
time of a closed checkpoint's upload process, so lingering that long fails too."""


def upload_processes() -> set[int]:
    """This process's running children that are upload processes (from ``/proc``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if stat[0] == "Z":  # ended, not yet reaped
            continue
        if int(stat[1]) == os.getpid() and _uploader.CHILD_MODULE.encode() in cmdline:
            found.add(int(entry.name))
    return found


def left_behind(
    threads_before: set[threading.Thread], *, non_daemon: bool = False
) -> list[threading.Thread]:
    """The threads started since ``threads_before`` still running that are taskpoint's
    (which should all have ended), and with ``non_daemon`` any that is not a daemon (what
    Lightning's test harness rejects)."""
    return [
        t for t in set(threading.enumerate()) - threads_before
        if t.is_alive() and ((non_daemon and not t.daemon) or t.name.startswith("taskpoint"))
    ]


def assert_nothing_left(
    threads_before: set[threading.Thread],
    processes_before: set[int],
    *,
    after: str,
    non_daemon: bool = False,
) -> float:
    """Wait (at most :data:`ENDED_WITHIN_S`) until no thread :func:`left_behind` names and
    no upload process started since ``processes_before`` runs; how long that took.
    ``after`` names what just ended, for the failure message."""
    started = time.monotonic()
    while (
        left_behind(threads_before, non_daemon=non_daemon)
        or upload_processes() - processes_before
    ):
        assert time.monotonic() - started < ENDED_WITHIN_S, (
            f"left behind after {after}: threads "
            f"{left_behind(threads_before, non_daemon=non_daemon)}, upload processes "
            f"{upload_processes() - processes_before}"
        )
        time.sleep(0.05)
    return time.monotonic() - started

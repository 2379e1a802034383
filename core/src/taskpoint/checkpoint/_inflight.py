"""Uploads in flight from other processes on this machine: marked by locked files, waited for.

The upload process (:mod:`taskpoint.checkpoint._uploader`) outlives the training process
that started it, on purpose: a save in flight when its attempt dies still commits. A retry
on the same machine that restored at once would miss it (it would restore the checkpoint
before, and lose the steps between). So each commit the upload process runs holds a marker
for its location (:func:`hold`), and every restore first waits (:func:`wait`, called from
:meth:`taskpoint.Checkpoint.load_sync`) until no marker of its location is held, at most
:func:`wait_bound` seconds: the grace period (``TASKPOINT_GRACE_PERIOD``, default 30 s).

A marker is a small file in :func:`folder` (``<tempdir>/taskpoint-<uid>/uploads``), named
for a hash of the location, which its process holds locked (``flock(2)``) while the commit
runs and removes when it ends. The kernel drops a lock when its process ends, however it
ends: a marker left by an upload process that was killed, or crashed, is unlocked, and a
waiter removes it rather than wait for it. An upload that hangs is waited for until the
bound only. A marker is created under a temporary name, locked, then renamed into place,
so a waiter never finds one unlocked that is still being taken.

What this cannot see: a save still queued in the dead training process (it died with it),
one in a thread of that process (``background_upload="thread"``, likewise), and the
instant between the training process sending a save and its upload process marking it
(well under a millisecond, against the seconds a new process takes to start). A retry in
another container sees another temporary folder: it only waits where ``/tmp`` is shared.

Markers are an optimisation of what a restore picks, never a correctness condition: if
none can be made (a read-only temporary folder), the save goes on unmarked, and a restore
that cannot read the folder does not wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from taskpoint import preemption

__all__ = ["Marker", "folder", "hold", "in_flight", "wait", "wait_bound"]

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often :func:`wait` looks at the markers again (seconds)."""
_SUFFIX = ".upload"
_names = itertools.count()


@dataclass(frozen=True)
class Marker:
    """An upload in flight, as its marker describes it.

    Attributes:
        url: the location it commits to.
        pid: the process committing it (an upload process).
        started: when the commit began (Unix time, seconds).
    """

    url: str
    pid: int
    started: float


def folder() -> Path:
    """Where the markers live: ``taskpoint-<uid>/uploads`` in the temporary folder."""
    return Path(tempfile.gettempdir()) / f"taskpoint-{os.getuid()}" / "uploads"


def _normal(url: str) -> str:
    """``url`` in one spelling per location: a local path made absolute (``file://`` or
    none), any other URL without trailing slashes."""
    path = url.removeprefix("file://") if url.startswith("file://") else url
    if "://" not in path:
        return os.path.abspath(os.path.expanduser(path))
    return url.rstrip("/")


def _key(url: str) -> str:
    return hashlib.sha256(_normal(url).encode()).hexdigest()[:32]


def _own_folder() -> Path | None:
    """The marker folder, made if need be; ``None`` where it cannot be, or is not this
    user's alone (another user could forge markers in it)."""
    where = folder()
    try:
        where.parent.mkdir(mode=0o700, exist_ok=True)  # the temporary folder exists
        where.mkdir(mode=0o700, exist_ok=True)
        info = where.parent.lstat()
    except OSError as exc:
        log.debug("no upload markers: %s: %s", type(exc).__name__, exc)
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        log.debug("no upload markers: %s is not this user's alone", where.parent)
        return None
    return where


@contextlib.contextmanager
def hold(url: str) -> Iterator[None]:
    """Mark an upload to ``url`` as in flight from this process while the block runs.

    Never raises for the marker itself: where it cannot be made the block runs unmarked.
    """
    handle: int | None = None
    temp: str | None = None
    final: Path | None = None
    where = _own_folder()
    if where is not None:
        try:
            handle, temp = tempfile.mkstemp(prefix=".", suffix=".taking", dir=where)
            fcntl.flock(handle, fcntl.LOCK_EX)
            record = {"url": url, "pid": os.getpid(), "started": time.time()}
            os.write(handle, json.dumps(record).encode())
            final = where / (
                f"{_key(url)}.{os.getpid()}.{threading.get_ident()}.{next(_names)}{_SUFFIX}"
            )
            os.rename(temp, final)
        except OSError as exc:
            log.debug("upload of %s unmarked: %s: %s", url, type(exc).__name__, exc)
            if handle is not None:
                os.close(handle)
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            handle = final = None
    try:
        yield
    finally:
        if final is not None:
            with contextlib.suppress(OSError):
                final.unlink()  # before the lock goes: a waiter never finds it unlocked
        if handle is not None:
            os.close(handle)


def in_flight(url: str | None = None) -> list[Marker]:
    """The uploads in flight to ``url`` (``None``: to any location) from processes on this
    machine, as their markers say. Markers whose process has ended are removed."""
    where = folder()
    prefix = "" if url is None else f"{_key(url)}."
    try:
        names = [n for n in os.listdir(where) if n.startswith(prefix) and n.endswith(_SUFFIX)]
    except OSError:
        return []
    found: list[Marker] = []
    for name in names:
        path = where / name
        try:
            handle = os.open(path, os.O_RDONLY)
        except OSError:  # it ended meanwhile
            continue
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: the upload runs
                found.append(_read(handle, path))
                continue
            except OSError:
                continue
            # Unlocked: its holder ended without removing it (killed mid-upload), or is
            # removing it now. Either way it marks nothing any more.
            with contextlib.suppress(OSError):
                path.unlink()
            log.debug("removed the marker %s of an upload process that ended", path)
        finally:
            os.close(handle)
    return found


def _read(handle: int, path: Path) -> Marker:
    """The marker ``path`` says; what cannot be read of it comes from its name."""
    parts = path.name.split(".")
    pid = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0
    try:
        data = json.loads(os.pread(handle, 65536, 0))
        return Marker(str(data["url"]), int(data["pid"]), float(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Marker("", pid, 0.0)


def wait_bound() -> float:
    """How long a restore waits for uploads in flight, in seconds: the grace period
    (``TASKPOINT_GRACE_PERIOD``, default 30 s), the time a dying attempt is given.

    Raises:
        ValueError: ``TASKPOINT_GRACE_PERIOD`` is set to something other than seconds.
    """
    return preemption.grace_period()


def wait(url: str, timeout: float) -> bool:
    """Wait until no process on this machine uploads to ``url``, at most ``timeout``
    seconds; log what is waited for (INFO) and an upload still running at the end (WARNING).

    Returns:
        Whether none is in flight any more.
    """
    deadline = time.monotonic() + timeout
    held = in_flight(url)
    if not held:
        return True
    started = time.monotonic()
    log.info(
        "waiting up to %.1f s for %d upload(s) to %s still in flight from process(es) %s "
        "(an earlier attempt's), so the newest checkpoint is restored",
        timeout, len(held), url, ", ".join(str(m.pid) for m in held),
    )
    while held:
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning(
                "%d upload(s) to %s still in flight after %.1f s (process(es) %s); "
                "restoring without them (set TASKPOINT_GRACE_PERIOD to wait longer)",
                len(held), url, timeout, ", ".join(str(m.pid) for m in held),
            )
            return False
        time.sleep(min(POLL_S, left))
        held = in_flight(url)
    log.info("the uploads in flight to %s ended after %.1f s", url, time.monotonic() - started)
    return True

"""Restore folders in the system's temporary directory, and their removal.

A load without ``into`` restores under a ``taskpoint-restore-*`` folder of
``tempfile.gettempdir()`` that its process owns: :func:`restore_folder` makes it, and it is
removed at interpreter exit. A process killed outright (SIGKILL, the OOM killer) runs no
exit handler and leaves a whole checkpoint behind, once per life: retries on one machine
(``isolation="process"``, a scheduler that requeues on the same node) would fill its disk.
So each folder holds an ``.owner`` file its process keeps locked (``flock``) while it
lives; the kernel releases the lock when the process dies, however it dies, and the next
:func:`restore_folder` of any process removes the folders whose lock it can take. A forked
child shares its parent's lock and leaves its parent's folders in place at its exit. A
folder without an ``.owner`` file (one being made, or made by an older taskpoint) is left
alone. Without ``fcntl`` (Windows) nothing is swept.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["PREFIX", "restore_folder"]

log = logging.getLogger(__name__)

PREFIX = "taskpoint-restore-"
"""How the name of a restore folder in the temporary directory starts."""

_OWNER = ".owner"
_held: dict[str, tuple[int, int]] = {}  # folder -> (its maker's pid, the lock's descriptor)
_swept: set[str] = set()  # temporary directories this process has swept


@atexit.register
def _remove_own() -> None:
    pid = os.getpid()
    for folder, (maker, _fd) in list(_held.items()):
        if maker == pid:  # not a forked child's exit: the parent still uses them
            shutil.rmtree(folder, ignore_errors=True)


def restore_folder() -> Path:
    """A new restore folder in the temporary directory, owned by this process and removed
    at its exit, after removing those of processes that died (once per process).

    Raises:
        OSError: the temporary directory cannot be written.
    """
    parent = tempfile.gettempdir()
    if parent not in _swept:
        _swept.add(parent)
        _sweep(parent)
    folder = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    try:
        _held[folder] = (os.getpid(), _take_ownership(folder))
    except BaseException:  # no owner file: no sweep would ever remove it
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return Path(folder)


def _sweep(parent: str) -> None:
    """Remove the restore folders in ``parent`` whose owning process has died.

    A folder whose owner lock cannot be taken (its process, or a process forked from it,
    lives: this one's own too, since a lock taken anew conflicts with the one it holds) or
    that has no owner file is kept; one that cannot be removed is logged and kept.
    """
    if fcntl is None:
        return
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        folder = os.path.join(parent, name)
        if not _dead(os.path.join(folder, _OWNER)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(folder):
            log.warning("could not remove %s, left by a process that died", folder)
        else:
            log.info("removed %s, left by a process that died", folder)


def _take_ownership(folder: str) -> int:
    """Lock ``folder``'s owner file for this process's life and return its descriptor:
    locked under another name and then renamed, so that no sweep ever finds it unlocked."""
    if fcntl is None:
        return -1
    staging = os.path.join(folder, f"{_OWNER}.new")
    fd = os.open(staging, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(staging, os.path.join(folder, _OWNER))
    return fd


def _dead(owner: str) -> bool:
    """Whether the process that locked ``owner`` has died: its lock can be taken."""
    assert fcntl is not None
    try:
        fd = os.open(owner, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # no owner file: being made, or an older taskpoint's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True

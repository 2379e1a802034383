"""Scratch folders on the local disk that outlive no process using them: restores, the
snapshots of background saves and whole-object downloads, and their removal.

A load without ``into`` restores under a ``taskpoint-restore-*`` folder of
``tempfile.gettempdir()`` (:func:`restore_folder`); a background save snapshots what it
was given into a ``.taskpoint-snapshot-*`` folder, beside it (links) or in the temporary
directory (a copy), which the upload process reads while it commits
(:func:`owned_folder`); a read from an object store downloads the object whole into a
``taskpoint-download-*`` folder first, and a streamed write to one spools past its first
part into a ``taskpoint-upload-*`` folder; a framework adapter writes what it is about to
save (a serialised state, a sharded save's staged files) into a ``taskpoint-scratch-*``
folder (:func:`scratch_folder`). Each is removed by the code that is done with it, or at
interpreter exit. A process killed outright (SIGKILL, the OOM killer) runs neither, and
leaves a whole checkpoint behind, once per life: retries on one machine
(``isolation="process"``, a scheduler that requeues on the same node) would fill its disk.

So each folder holds an ``.owner`` file that every process using the folder keeps locked
(a shared ``flock``) while it uses it: its maker, and for a snapshot the upload process
committing it (:func:`adopt`, then :func:`let_go`). The kernel releases a process's lock
when the process dies, however it dies. A folder whose owner file no process holds is
dead: the first :func:`owned_folder` of any process in a parent folder removes the dead
folders there, and an upload process that lets go of a snapshot its maker no longer
holds (the training process was killed while the upload ran) removes it. A forked child
shares its parent's lock and leaves its parent's folders in place at its exit. A folder
without an ``.owner`` file (one being made, or made by an older taskpoint) is left alone.
Without ``fcntl`` (Windows) nothing is locked or swept.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DOWNLOAD_PREFIX",
    "PREFIX",
    "SCRATCH_PREFIX",
    "SNAPSHOT_PREFIX",
    "UPLOAD_PREFIX",
    "adopt",
    "let_go",
    "owned_folder",
    "remove",
    "restore_folder",
    "scratch_folder",
    "snapshot_parent",
]

log = logging.getLogger(__name__)

PREFIX = "taskpoint-restore-"
"""How the name of a restore folder in the temporary directory starts."""
SNAPSHOT_PREFIX = ".taskpoint-snapshot-"
"""How the name of a background save's snapshot starts (hidden: it may lie in the user's
own folder)."""
DOWNLOAD_PREFIX = "taskpoint-download-"
"""How the name of a folder holding an object downloaded whole to be read starts."""
UPLOAD_PREFIX = "taskpoint-upload-"
"""How the name of a folder holding a streamed write's spool starts."""
SCRATCH_PREFIX = "taskpoint-scratch-"
"""How the name of a framework adapter's folder of files on their way to a save starts."""
_PREFIXES = (PREFIX, SNAPSHOT_PREFIX, DOWNLOAD_PREFIX, UPLOAD_PREFIX, SCRATCH_PREFIX)

_OWNER = ".owner"
_lock = threading.Lock()
_held: dict[str, tuple[int, int]] = {}  # folder -> (the holding process's pid, its lock's fd)
_swept: set[str] = set()  # parent folders this process has swept


@atexit.register
def _let_go_of_own() -> None:
    pid = os.getpid()
    for folder, (holder, _fd) in list(_held.items()):
        if holder == pid:  # not a forked child's exit: the parent still uses them
            let_go(folder)


def restore_folder() -> Path:
    """A new restore folder in the temporary directory (see :func:`owned_folder`).

    Raises:
        OSError: the temporary directory cannot be written.
    """
    return owned_folder(PREFIX)


def scratch_folder(parent: str | os.PathLike[str] | None = None) -> Path:
    """A new folder for files a framework adapter writes to save them (a serialised state,
    a sharded save's staged files), in ``parent`` (default: the temporary directory),
    held by this process until :func:`remove` (at interpreter exit at the latest): a
    process killed while it saves leaves it to the next process's sweep, not on the disk
    for good. See :func:`owned_folder`.

    Raises:
        OSError: ``parent`` cannot be written; nothing is left behind.
    """
    return owned_folder(SCRATCH_PREFIX, None if parent is None else os.fspath(parent))


def snapshot_parent(path: Path) -> str:
    """The folder a linked snapshot of ``path`` goes in: beside it, on its file system; or,
    where ``path`` lies in a scratch folder (at any depth), beside that folder, since its
    maker removes it with all it holds as soon as the snapshot is taken (the PyTorch
    adapter's serialised state)."""
    for folder in path.parents:
        if folder.name.startswith(_PREFIXES) and (folder / _OWNER).exists():
            return str(folder.parent)
    return str(path.parent)


def owned_folder(prefix: str, parent: str | None = None) -> Path:
    """A new folder in ``parent`` (default: the temporary directory) whose name starts with
    ``prefix`` (one of this module's prefixes), held by this process until :func:`remove`
    or :func:`let_go` (at interpreter exit at the latest); the first call of a process in
    ``parent`` first removes the folders there of processes that died.

    Raises:
        OSError: ``parent`` cannot be written; nothing is left behind.
        ValueError: ``prefix`` is not one of this module's.
    """
    if prefix not in _PREFIXES:
        raise ValueError(f"a scratch folder's prefix is one of {_PREFIXES}; got {prefix!r}")
    parent = parent or tempfile.gettempdir()
    with _lock:
        first = parent not in _swept
        _swept.add(parent)
    if first:
        _sweep(parent)
    folder = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        fd = _take_ownership(folder)
    except BaseException:  # no owner file: no sweep would ever remove it
        shutil.rmtree(folder, ignore_errors=True)
        raise
    with _lock:
        _held[folder] = (os.getpid(), fd)
    return Path(folder)


def remove(folder: str | os.PathLike[str]) -> None:
    """Remove ``folder`` and this process's hold on it, whoever else holds it. Never fails;
    a folder that cannot be removed is left to a later sweep."""
    key = os.fspath(folder)
    shutil.rmtree(key, ignore_errors=True)
    _release(key)


def adopt(folder: str | os.PathLike[str]) -> None:
    """Hold ``folder``, made by another process, until :func:`let_go`: the upload process
    does, for the snapshot it commits, so that the snapshot outlives its maker's death
    until the commit ends. A folder without an owner file is not held. Never fails."""
    key = os.fspath(folder)
    if fcntl is None:
        return
    try:
        fd = os.open(os.path.join(key, _OWNER), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return
    with _lock:
        _held[key] = (os.getpid(), fd)


def let_go(folder: str | os.PathLike[str]) -> None:
    """Drop this process's hold on ``folder`` and remove it if no other process holds it
    (its maker died, or was done with it). Never fails."""
    key = os.fspath(folder)
    _release(key)
    if fcntl is not None and _dead(os.path.join(key, _OWNER)):
        shutil.rmtree(key, ignore_errors=True)


def _release(folder: str) -> None:
    with _lock:
        held = _held.pop(folder, None)
    if held is not None and held[1] >= 0:
        os.close(held[1])


def _sweep(parent: str) -> None:
    """Remove the scratch folders in ``parent`` that no live process holds.

    A folder whose owner lock cannot be taken (a process holds it: its maker, a process
    forked from it, an upload process; this one too, since a lock taken anew conflicts
    with one it holds) or that has no owner file is kept; one that cannot be removed is
    logged and kept.
    """
    if fcntl is None:
        return
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_PREFIXES)]
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
    """Lock ``folder``'s owner file (shared) for this process and return the descriptor:
    locked under another name and then renamed, so that no sweep ever finds it unlocked.
    On a file system without ``flock`` (some network ones) the folder gets no owner file
    and ``-1`` is returned: it works, and is never swept."""
    if fcntl is None:
        return -1
    staging = os.path.join(folder, f"{_OWNER}.new")
    fd = os.open(staging, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        log.debug("no owner lock for %s (%s): it is not swept", folder, exc)
        os.close(fd)
        os.unlink(staging)
        return -1
    try:
        os.replace(staging, os.path.join(folder, _OWNER))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _dead(owner: str) -> bool:
    """Whether no process holds ``owner`` any more: an exclusive lock on it can be taken."""
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

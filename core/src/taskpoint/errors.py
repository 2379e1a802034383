"""The exceptions taskpoint raises.

Every failure that is taskpoint's own derives from :class:`CheckpointError`::

    CheckpointError
    ├── CheckpointStoreError      the store could not be reached, read or written
    ├── CheckpointSaveError       a save failed for a reason not the store's (its source
    │                             could not be read, or an internal error): nothing committed
    ├── CheckpointCorruptError    checkpoints exist, but none passes its checksum
    ├── CheckpointUnsafeError     an archive entry would escape the restore directory
    ├── CheckpointFormatError     a manifest from a newer (or unknown) format
    ├── CheckpointRestoreError    the local disk refused the restored files (full, too
    │                             large, permission): the checkpoint itself is fine
    ├── CheckpointCoordinationError  writers of one checkpoint disagreed, collided or
    │                             did not all arrive; ``committed`` says whether the
    │                             checkpoint was committed all the same
    ├── CheckpointClosedError     a save on a ``Checkpoint`` that was closed
    └── TaskAttemptError          a process-isolated attempt died (signal, exit code)

Bad arguments raise the builtin exceptions Python users expect: ``TypeError`` for a
value of the wrong kind, ``ValueError`` for a bad value and ``FileNotFoundError`` for a
path that does not exist.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CheckpointClosedError",
    "CheckpointCoordinationError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointRestoreError",
    "CheckpointSaveError",
    "CheckpointStoreError",
    "CheckpointUnsafeError",
    "TaskAttemptError",
    "TaskpointWarning",
    "warn",
]


class CheckpointError(Exception):
    """Base class of every error taskpoint raises for a checkpoint.

    Every one pickles with its message and attributes, so it can cross processes (a
    process-isolated attempt, the background upload process).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


def _rebuild(cls: type[CheckpointError], message: str, state: dict[str, Any]) -> CheckpointError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class CheckpointStoreError(CheckpointError):
    """The store at ``url`` failed, after retries where the failure looked transient.

    Attributes:
        url: the URL of the object or prefix that failed.
    """

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class _SaveStopped(CheckpointError):
    """A background save stopped before its commit, because a save that training waits
    for replaced it (internal: counted as coalesced, never raised to the caller)."""


class CheckpointSaveError(CheckpointError):
    """A save failed for a reason that is not the store's: a file of its source vanished
    or could not be read while it was saved, or taskpoint itself failed.

    The save committed nothing, and every checkpoint committed before it is untouched.
    The original exception is chained as ``__cause__``.

    Attributes:
        url: the checkpoint location the save was for; ``None`` when it failed before
            reaching one (taking a background save's snapshot).
    """

    def __init__(self, message: str, *, url: str | None) -> None:
        super().__init__(message)
        self.url = url


class CheckpointClosedError(CheckpointError):
    """A save was started on a :class:`~taskpoint.Checkpoint` after its ``close()``.

    Nothing was saved. Loading through a closed checkpoint still works; to save again,
    make a new ``Checkpoint`` for the location.

    Attributes:
        url: the checkpoint location.
    """

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class CheckpointCorruptError(CheckpointError):
    """Committed checkpoints exist but none is intact (checksum, size or manifest).

    Attributes:
        url: the checkpoint location that was searched.
        skipped: the manifest URLs that were tried and rejected, newest first.
    """

    def __init__(self, message: str, *, url: str, skipped: list[str] | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.skipped = list(skipped or [])


class CheckpointUnsafeError(CheckpointError):
    """An archive entry is an absolute path, climbs out with ``..``, links outside the
    tree, or is a device or other special file. Nothing is written for it."""


class CheckpointFormatError(CheckpointError):
    """A manifest is from a format this version of taskpoint cannot read."""


class CheckpointRestoreError(CheckpointError):
    """Writing a restored checkpoint to local disk failed: the disk is full, a file is
    larger than the process may write, or a permission was refused.

    The checkpoint is not at fault: it is neither skipped nor marked bad, and nothing in
    the store is changed. Free space or fix the restore directory, then load again.

    Attributes:
        path: the local path being written.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class CheckpointCoordinationError(CheckpointError):
    """The writers of one checkpoint could not all finish it together.

    Raised on every writer: they named different locations or world sizes, two wrote the
    same path with different content, one failed, or one did not arrive in time. Also
    raised by a restore of a part or of paths the checkpoint does not have, and on every
    rank of a distributed restore that failed on one of them.

    Usually nothing was committed. But a rank may vanish after the committing rank has
    gathered its part: the commit then stands, and a rank that did not hear so from the
    committing rank (which vanished itself after committing, say) raises this error with
    ``committed`` set, since the group can no longer work together.

    Attributes:
        ranks: the writers (ranks) the error is about: those missing, in conflict, or
            failed. Every rank names the same ones where they all saw the same thing (a
            rank that gives up waiting names those it did not see arrive).
        committed: the URL of the manifest that was committed despite the error (the
            checkpoint loads); ``None`` when this rank knows of no commit.
    """

    def __init__(
        self, message: str, *, ranks: list[int] | None = None, committed: str | None = None
    ) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])
        self.committed = committed


class TaskAttemptError(CheckpointError):
    """A process-isolated attempt ended without a result: killed by a signal, exited with
    a non-zero code, or raised an exception that could not be sent back.

    Attributes:
        returncode: the child's exit status (negative: the signal number that killed it).
        traceback: the child's traceback text, when it had one.
    """

    def __init__(self, message: str, *, returncode: int | None, traceback: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.traceback = traceback


class TaskpointWarning(UserWarning):
    """Warnings taskpoint issues (a skipped corrupt checkpoint, for example)."""


def warn(logger: logging.Logger, message: str, *, stacklevel: int = 2) -> None:
    """Say ``message`` both ways taskpoint warns: at WARNING on ``logger`` (the job's logs)
    and as a :class:`TaskpointWarning` (what ``pytest.warns`` and ``-W error`` see).

    Args:
        logger: the caller's logger; ``message`` is logged as it is (no ``%`` formatting).
        message: what to say.
        stacklevel: as :func:`warnings.warn`'s, counted from the caller of :func:`warn`
            (2, the default, blames whoever called that caller).
    """
    logger.warning("%s", message)
    warnings.warn(message, TaskpointWarning, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def _save_failures(url: str, what: str) -> Iterator[None]:
    """Raise what fails inside as :class:`CheckpointSaveError` about ``what`` (a phrase
    like ``"saving checkpoint 3 of attempt 0"``) at ``url``; taskpoint's own errors pass
    unchanged. Exceptions other than ``Exception`` (KeyboardInterrupt) pass too."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointSaveError(
            f"{what} to {url} failed ({type(exc).__name__}: {exc}); nothing was committed "
            "and earlier checkpoints are untouched",
            url=url,
        ) from exc

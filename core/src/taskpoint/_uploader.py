"""Background saves in a separate process, so the upload never holds the training loop's GIL.

Hashing, packing, compressing and the client libraries' request handling are Python work;
in a thread of the training process they take turns with the training loop for the GIL
(measured here: 0.53-0.88x of the loop's step rate while an upload ran). PyTorch's own
asynchronous checkpointing moved its upload out of the training process for the same
reason. A :class:`Worker` is one long-lived child process (running :func:`main`) per
checkpoint, started at the first background save and closed at interpreter exit. Requests and
replies are pickled frames over its standard input and output; the child points its own
``sys.stdout`` at standard error first, so nothing it prints can corrupt a frame.

The child runs at a lower CPU priority and ignores SIGINT and SIGTERM: a preempted attempt
waits for the upload in flight, then ends. It exits when its standard input closes, which
is also what the parent's death does: an upload in flight then still commits, as a zombie
attempt's would, and a newer attempt's checkpoints outrank it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from taskpoint.errors import CheckpointError

__all__ = ["Request", "Worker", "WorkerDied"]

_HEADER = struct.Struct("<Q")
NICE = 10
"""The nice value of the upload process, below the training loop."""
_CHILD = (
    "import os, sys\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[1]))\n"
    "except OSError:\n    pass\n"
    "from taskpoint._uploader import main\nfrom taskpoint.checkpoint import commit_request\n"
    "raise SystemExit(main(commit_request))\n"
)
"""The child's program, given its nice value as its argument. It sets its priority first,
so that importing taskpoint and the storage clients (a second of CPU) never competes with
the training loop, and absolutely, not relative to the background thread that starts it
(itself niced). It names the handler only here, as text: this module sits below
:mod:`taskpoint.checkpoint` and never imports it."""


def _child_nice() -> int:
    """The upload process's nice value: :data:`NICE` below this process's own."""
    return min(os.getpriority(os.PRIO_PROCESS, os.getpid()) + NICE, 19)


_workers: list[Worker] = []


@atexit.register
def _close_workers() -> None:
    for worker in _workers:
        worker.close()


class WorkerDied(CheckpointError):
    """The upload process ended before it answered (killed, or out of memory)."""


@dataclass(frozen=True)
class Request:
    """One save for the child to commit: what :meth:`taskpoint._save.Saver.commit` needs,
    picklable."""

    options: dict[str, Any]  # Checkpoint constructor arguments
    attempt: int
    seq: int
    source: Any  # taskpoint._save.Source
    intact: frozenset[tuple[str, str]]  # (manifest key, checksum) the parent knows intact


def _send(stream: IO[bytes], message: object) -> None:
    blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(blob)))
    stream.write(blob)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    (size,) = _HEADER.unpack(header)
    blob = stream.read(size)
    if len(blob) < size:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(blob)


class Worker:
    """The parent's handle on one upload process; :meth:`run` is one request at a time.

    Every worker is closed at interpreter exit (:meth:`close`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        _workers.append(self)

    def run(self, request: Request) -> Any:
        """Have the child commit ``request``; what it returned, or raise what it raised.

        Raises:
            WorkerDied: the child ended without an answer (the request is lost; a new
                child starts at the next call).
            Exception: what the save raised in the child.
        """
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, request)
                ok, value = _receive(proc.stdout)
            except (OSError, EOFError) as exc:
                self._proc = None
                try:
                    code: int | None = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = None
                    proc.kill()
                raise WorkerDied(
                    f"the background upload process died ({_describe(code)}); the save did "
                    "not commit"
                ) from exc
        if ok:
            return value
        raise value

    def _start(self) -> subprocess.Popen[bytes]:
        """The running child, started if needed; it has said it is ready when this returns."""
        if self._proc is None or self._proc.poll() is not None:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(_child_nice())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            assert proc.stdout is not None
            try:
                _receive(proc.stdout)  # its signal handlers and priority are in place
            except EOFError as exc:
                raise WorkerDied(
                    f"the background upload process did not start ({_describe(proc.wait())})"
                ) from exc
            self._proc = proc
        return self._proc

    def close(self) -> None:
        """Let the child finish its current request and exit."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _describe(code: int | None) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def main(handle: Callable[[Request], Any]) -> int:
    """The child's loop: ``handle`` each request, answer ``(ok, value)``; exit at end of input.

    Args:
        handle: commits one request and returns what the parent's :meth:`Worker.run`
            returns (:func:`taskpoint.checkpoint.commit_request`).
    """
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to standard error, never into a reply
    requests = sys.stdin.buffer
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    _send(replies, (True, "ready"))
    while True:
        try:
            request: Request = _receive(requests)
        except EOFError:
            return 0
        try:
            result: tuple[bool, Any] = (True, handle(request))
        except Exception as exc:  # sent back and raised in the parent
            result = (False, exc)
        try:
            _send(replies, result)
        except pickle.PicklingError:
            _send(replies, (False, CheckpointError(f"{type(result[1]).__name__}: {result[1]}")))


"""Background saves in a separate process, so the upload never holds the training loop's GIL.

Hashing, packing, compressing and the client libraries' request handling are Python work;
in a thread of the training process they take turns with the training loop for the GIL
(measured here: 0.53-0.88x of the loop's step rate while an upload ran). PyTorch's own
asynchronous checkpointing moved its upload out of the training process for the same
reason.

One upload process serves a whole Python process (a job, or one attempt of it): every
:class:`taskpoint.Checkpoint` hands its background saves to :func:`shared`'s
:class:`Worker`, which starts the child (running :func:`main`) at the first background
save, without waiting for it, and keeps it until interpreter exit (or a fork, whose child
starts its own). The child commits each request in a thread of its own, so the checkpoints
of one job never queue behind one another; each checkpoint sends one save at a time. The
child runs with the environment (credentials, endpoints) the parent had when it started
it: once the parent's storage environment (:data:`STORE_ENV_PREFIXES`: credentials,
endpoints, proxies, CA bundles) differs, the next save starts a new child and the old one
exits after answering its requests. Other variables are not compared: frameworks set
their own during training, and a new child per save would leave the saves made while it
starts to threads of the training process, lost with it.
Requests and replies are pickled frames over its standard input and output, each tagged
with its request's number; the child points its own ``sys.stdout`` at standard error
first, so nothing it prints can corrupt a frame.

The child runs at a lower CPU priority and ignores SIGINT and SIGTERM: a preempted attempt
waits for the upload in flight, then ends. It exits once its standard input has closed and
its requests are answered, which is also what the parent's death does: an upload in flight
then still commits, as a zombie attempt's would, and a newer attempt's checkpoints outrank
it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
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

__all__ = ["STORE_ENV_PREFIXES", "Request", "Worker", "WorkerDied", "main", "shared"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<QQ")  # the request's number, the pickle's size in bytes
_READY = 0
"""The number of the child's first frame, which says it is ready; requests count from 1."""
NICE = 10
"""The nice value of the upload process, below the training loop."""
_CHILD = (
    "import os, sys\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[1]))\n"
    "except OSError:\n    pass\n"
    "from taskpoint.checkpoint._uploader import main\n"
    "from taskpoint.checkpoint.checkpoint import commit_request\n"
    "raise SystemExit(main(commit_request))\n"
)
"""The child's program, given its nice value as its argument. It sets its priority first,
so that importing taskpoint and the storage clients (a second of CPU) never competes with
the training loop, and absolutely, not relative to the background thread that starts it
(itself niced). It names the handler only here, as text: this module sits below
:mod:`taskpoint.checkpoint.checkpoint` and never imports it."""
CLOSE_WAIT_S = 30.0
"""How long :func:`close_shared` waits, by default, for the child to finish its requests."""


def _child_nice() -> int:
    """The upload process's nice value: :data:`NICE` below this process's own."""
    return min(os.getpriority(os.PRIO_PROCESS, os.getpid()) + NICE, 19)


class WorkerDied(CheckpointError):
    """The upload process ended before it answered (killed, or out of memory)."""


@dataclass(frozen=True)
class Request:
    """One save for the child to commit: what :meth:`taskpoint.checkpoint._save.Saver.commit` needs,
    picklable."""

    options: dict[str, Any]  # Checkpoint constructor arguments
    attempt: int
    seq: int
    source: Any  # taskpoint.checkpoint._save.Source
    intact: frozenset[tuple[str, str]]  # (manifest key, checksum) the parent knows intact


def _send(stream: IO[bytes], number: int, message: object) -> None:
    """Write ``message`` as frame ``number``; pickling it fails before anything is written."""
    blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(number, len(blob)))
    stream.write(blob)
    stream.flush()


def _receive(stream: IO[bytes]) -> tuple[int, bytes]:
    """The next frame: its request's number and its pickle (unpickled by the caller, so a
    reply that does not unpickle still answers its request)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    number, size = _HEADER.unpack(header)
    blob = stream.read(size)
    if len(blob) < size:
        raise EOFError("the other side closed the pipe mid-message")
    return number, blob


def _describe(code: int | None) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class _Reply:
    """One request's answer, once the child (or its death) gave it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.value: Any = None

    def give(self, ok: bool, value: Any) -> None:
        self.ok, self.value = ok, value
        self.done.set()


class _Child:
    """One upload process: started, then read, by a thread of its own, until it ends.

    The thread starts the process, waits for its ready frame, then hands each reply to
    the request waiting for it; when the process ends, every request still waiting fails
    with :class:`WorkerDied`.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.ready = threading.Event()
        self.ended = threading.Event()
        self.started = threading.Event()  # ready, or ended without starting
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending: dict[int, _Reply] = {}
        self._numbers = itertools.count(_READY + 1)
        self._closing = False
        self._why = "it has not started"
        threading.Thread(target=self._serve, name="taskpoint-upload-process", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self.ready.is_set() else None

    def _serve(self) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(_child_nice())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**self.env, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            self._failed_start(f"it could not start: {exc}")
            return
        assert proc.stdout is not None
        with self._lock:
            self._proc = proc
            if self._closing:  # closed while it started: it holds no request
                proc.kill()
        try:
            _receive(proc.stdout)  # its signal handlers and priority are in place
        except (EOFError, OSError):
            status = proc.wait()
            if self._closing:
                self._end("it was closed as it started")
            else:
                self._failed_start(f"it did not start ({_describe(status)})")
            return
        self.ready.set()
        self.started.set()
        while True:
            try:
                number, blob = _receive(proc.stdout)
            except (EOFError, OSError):
                break
            try:
                ok, value = pickle.loads(blob)
            except Exception as exc:  # a reply this process cannot rebuild
                ok, value = False, CheckpointError(
                    f"the upload process's reply could not be read ({type(exc).__name__}: "
                    f"{exc})"
                )
            with self._lock:
                reply = self._pending.pop(number, None)
            if reply is not None:
                reply.give(ok, value)
        try:
            code: int | None = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
            proc.kill()
        self._end(_describe(code))

    def _failed_start(self, why: str) -> None:
        log.warning("the background upload process failed: %s; background saves upload "
                    "from a thread of this process until one starts", why)
        self._end(why)

    def _end(self, why: str) -> None:
        with self._lock:
            self._why = why
            self.ended.set()
            self.started.set()
            pending, self._pending = self._pending, {}
        for reply in pending.values():
            reply.give(False, self.died())

    def died(self) -> WorkerDied:
        return WorkerDied(
            f"the background upload process died ({self._why}); the save did not commit"
        )

    def run(self, request: Request) -> Any:
        """Send ``request`` to the ready child and wait for its answer (see :meth:`Worker.run`)."""
        reply = _Reply()
        with self._lock:
            if self.ended.is_set() or self._closing:
                raise self.died()
            number = next(self._numbers)
            self._pending[number] = reply
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        try:
            with self._send_lock:
                _send(proc.stdin, number, request)
        except (OSError, ValueError) as exc:  # a closed pipe: the child is gone
            with self._lock:
                self._pending.pop(number, None)
            self.ended.wait(10)
            raise self.died() from exc
        reply.done.wait()
        if reply.ok:
            return reply.value
        raise reply.value

    def close(self, timeout: float | None) -> bool:
        """Close the child's input: it finishes its requests, then exits. One still
        starting is ended now (it holds no request).

        Returns:
            Whether it ended within ``timeout`` seconds (``None``: no limit); one that did
            not goes on, to finish its requests, and is never killed.
        """
        with self._lock:
            self._closing = True
            if not self.ended.is_set():
                self._why = "it was closed"
            proc = self._proc
            if proc is not None and not self.ready.is_set():
                proc.kill()
        if proc is None:
            return True
        with self._send_lock, contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


STORE_ENV_PREFIXES = (
    "AWS_", "AZURE_", "GOOGLE_", "GCE_", "GCS", "CLOUDSDK_", "STORAGE_EMULATOR_HOST",
    "FSSPEC", "TASKPOINT_", "S3_", "BOTO", "ADLFS", "OBSTORE", "HTTP_PROXY", "HTTPS_PROXY",
    "NO_PROXY", "ALL_PROXY", "SSL_CERT_", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
)
"""Names (upper-cased) of the environment variables an upload depends on, by prefix."""


def _store_env(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.upper().startswith(STORE_ENV_PREFIXES)}


class Worker:
    """The parent's handle on the upload process; see :func:`shared` for the one in use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: _Child | None = None

    def start(self) -> None:
        """Start the upload process unless it runs or is starting with this process's
        storage environment; never waits for it. One started with another is told to exit
        once it has answered its requests."""
        env = dict(os.environ)
        with self._lock:
            old = self._child
            if (
                old is not None and not old.ended.is_set()
                and _store_env(old.env) == _store_env(env)
            ):
                return
            self._child = _Child(env)
        if old is not None and not old.ended.is_set():
            log.debug("the environment changed: a new upload process takes over")
            old.close(timeout=0)

    @property
    def ready(self) -> bool:
        """Whether the upload process has started, is running, and has this process's
        storage environment."""
        child = self._child
        return (
            child is not None and child.ready.is_set() and not child.ended.is_set()
            and _store_env(child.env) == _store_env(os.environ)
        )

    @property
    def pid(self) -> int | None:
        """The running upload process's id; ``None`` while none is ready."""
        child = self._child
        return child.pid if child is not None and not child.ended.is_set() else None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Start the upload process if needed and wait until it is ready.

        Returns:
            Whether it is ready; ``False`` if ``timeout`` seconds ran out or it failed
            to start.
        """
        self.start()
        child = self._child
        assert child is not None
        child.started.wait(timeout)
        return self.ready

    def run(self, request: Request) -> Any:
        """Have the child commit ``request``; what it returned, or raise what it raised.

        Starts the child first if none runs, and waits for it. Requests from several
        threads run in the child at once.

        Raises:
            WorkerDied: the child ended without an answer, or did not start (the request
                is lost; a new child starts at the next call).
            Exception: what the save raised in the child.
        """
        self.start()
        child = self._child
        assert child is not None
        child.started.wait()
        return child.run(request)

    def close(self, timeout: float | None = CLOSE_WAIT_S) -> bool:
        """Let the child finish its requests and exit, waiting for that up to ``timeout``
        seconds (``None``: no limit). A later :meth:`start` starts a new child.

        Returns:
            Whether no child runs any more; one still running after ``timeout`` finishes
            its requests on its own.
        """
        with self._lock:
            child, self._child = self._child, None
        return True if child is None else child.close(timeout)


_shared: Worker | None = None
_shared_pid = 0
_shared_lock = threading.Lock()


def shared() -> Worker:
    """This process's upload process handle, one per process: every checkpoint's."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid():  # a fork's child starts its own
            _shared, _shared_pid = Worker(), os.getpid()
        return _shared


def close_shared(timeout: float | None = CLOSE_WAIT_S) -> bool:
    """End this process's upload process once its requests are answered (see
    :meth:`Worker.close`); called at interpreter exit."""
    with _shared_lock:
        worker = _shared if _shared_pid == os.getpid() else None
    return True if worker is None else worker.close(timeout)


def _after_fork() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)
# A save made after the exit's settling (see taskpoint.checkpoint._settle):
atexit.register(close_shared)


def main(handle: Callable[[Request], Any]) -> int:
    """The child's loop: ``handle`` each request in a thread of its own, answer
    ``(ok, value)``; exit at end of input once every request is answered.

    Args:
        handle: commits one request and returns what the parent's :meth:`Worker.run`
            returns (:func:`taskpoint.checkpoint.checkpoint.commit_request`).
    """
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to standard error, never into a reply
    requests = sys.stdin.buffer
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    lock = threading.Lock()
    try:
        _send(replies, _READY, (True, "ready"))
    except OSError:  # the parent ended before the child was ready: nothing to serve
        return 0
    running: list[threading.Thread] = []
    while True:
        try:
            number, blob = _receive(requests)
        except EOFError:
            break
        thread = threading.Thread(
            target=_answer, args=(handle, number, blob, replies, lock),
            name=f"taskpoint-upload-{number}",
        )
        thread.start()
        running = [t for t in running if t.is_alive()] + [thread]
    for thread in running:
        thread.join()
    return 0


def _answer(
    handle: Callable[[Request], Any], number: int, blob: bytes, replies: IO[bytes],
    lock: threading.Lock,
) -> None:
    """Commit one request in the child and send its answer; a parent gone is no error."""
    try:
        result: tuple[bool, Any] = (True, handle(pickle.loads(blob)))
    except Exception as exc:  # sent back and raised in the parent
        result = (False, exc)
    try:
        pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an error that does not pickle: its type and message do
        result = (False, CheckpointError(f"{type(result[1]).__name__}: {result[1]}"))
    with lock, contextlib.suppress(OSError):  # the parent gone; the save committed anyway
        _send(replies, number, result)
